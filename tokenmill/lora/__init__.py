"""Multi-LoRA serving: peft adapters over one base model, batched together (issue 36).

request.py (what users pass, what the engine carries), peft_files.py (reading and checking
adapter folders), targets.py (which models, which shapes), registry.py (the front-end's
validated adapters), layers.py and manager.py (the runner's slots and grouped products).
"""

from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
