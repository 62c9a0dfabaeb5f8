"""Loading weights into models: streaming (name, tensor) iterators per format (safetensors,
GGUF, its converted cache), and the loader (loader.py load_model)."""
