"""RequestLog: one log line per request queued on the engine, with its prompt and sampling
parameters (vLLM's --enable-log-requests; --max-log-len cuts the prompt). Off by default, as
in vLLM: prompts may be private. The line carries the engine's request id, which the
server's other lines for that request share (the X-Request-Id it derives from).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len  # (checked by ServerLogging)

    def cut(self, prompt: Any) -> str:
        """The prompt as logged: text or token ids, at most max_log_len characters or ids."""
        if isinstance(prompt, dict):  # {"prompt": ...} or {"prompt_token_ids": [...]}
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt", prompt))
        n = self.max_log_len
        if isinstance(prompt, list):
            shown = prompt if n is None else prompt[:n]
            more = "" if len(shown) == len(prompt) else f" ... ({len(prompt)} ids)"
            return f"token ids {shown}{more}"
        text = str(prompt)
        shown = text if n is None else text[:n]
        more = "" if len(shown) == len(text) else f"... ({len(text)} characters)"
        return f"{shown!r}{more}"

    def log(self, request_id: str, prompt: Any, params: SamplingParams,
            lora: LoRARequest | None) -> None:
        logger.info("request %s: prompt %s, params %s%s", request_id, self.cut(prompt), params,
                    "" if lora is None else f", LoRA adapter {lora.lora_name}")
