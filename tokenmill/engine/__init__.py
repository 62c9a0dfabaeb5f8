"""The engine: requests in, outputs out; the offline LLM API on top of it."""
