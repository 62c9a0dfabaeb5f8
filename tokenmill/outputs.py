"""What the engine hands back to users: `RequestOutput` holding one `CompletionOutput` per sample.

Field names follow vLLM (`prompt`, `prompt_token_ids`, `outputs[i].text`, `.token_ids`,
`.finish_reason`), so code written against vLLM reads these unchanged. `finish_reason` is None
while a request is running, then "stop" (EOS, a stop token) or "length" (max_tokens or the
context length); "abort" marks a request the caller aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
