"""AdapterRegistry: the front-end's view of adapters, each folder read and checked once.

Every request naming a LoRARequest is resolved here before it is queued (engine/
request_intake.py): the folder (or a Hub id's snapshot, as vLLM takes lora_path: the cache
first, then adapter_config.json and the weights downloaded) is read, checked against the
model's shapes and the engine's limits (lora/peft_files.py), and hashed into the request's
`AdapterRef`. A folder is read again only when its files change (their sizes and modification
times), so a request for a known adapter costs a stat. An adapter that cannot be served fails
its request with a ValueError naming it; the engine serves on.
"""

from __future__ import annotations

import os
import threading

from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.peft_files import CONFIG_FILE, WEIGHT_FILES, check_adapter, read_adapter
from tokenmill.lora.request import AdapterRef, LoRARequest
from tokenmill.lora.targets import target_shapes
from tokenmill.model_loader.hub import parse_hub_id, resolve_hub_adapter


def _stamp(path: str) -> tuple[tuple[str, int, int], ...]:
    files = [os.path.join(path, f) for f in (CONFIG_FILE, *WEIGHT_FILES)]
    return tuple((f, st.st_size, st.st_mtime_ns) for f in files
                 if (st := os.stat(f) if os.path.exists(f) else None) is not None)


class AdapterRegistry:
    def __init__(self, hf_config: object, config: LoRAConfig | None,
                 hf_token: str | bool | None = None) -> None:
        self.config = config
        self.hf_token = hf_token  # adapters by Hub id are fetched with it (--hf-token)
        self.shapes = target_shapes(hf_config) if config is not None else {}
        self.num_layers = getattr(hf_config, "num_hidden_layers", 0)
        self._checked: dict[str, tuple[tuple, str, int]] = {}  # path → (stamp, key, rank)
        self._lock = threading.Lock()  # requests are prepared on a thread pool

    def resolve(self, request: LoRARequest | None) -> AdapterRef | None:
        """The request's adapter, checked (None for the base model); ValueError if it cannot
        be served."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}")
        if self.config is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: this engine serves no "
                             "adapters; start it with enable_lora=True (--enable-lora)")
        path = os.path.abspath(os.path.expanduser(request.lora_path))
        if not os.path.isdir(path):
            if parse_hub_id(request.lora_path) is None:
                raise ValueError(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} "
                                 "is not a folder")
            path = resolve_hub_adapter(request.lora_path,  # the cache first, as vLLM
                                       token=self.hf_token)
        stamp = _stamp(path)
        with self._lock:
            known = self._checked.get(path)
        if known is None or known[0] != stamp:
            adapter = read_adapter(path)
            check_adapter(adapter, self.shapes, self.num_layers, self.config.max_lora_rank)
            known = (stamp, adapter.key, adapter.config.r)
            with self._lock:
                self._checked[path] = known
        return AdapterRef(request.lora_name, request.lora_int_id, path, known[1], known[2])
