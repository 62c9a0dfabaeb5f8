"""POST /v1/embeddings (OpenAI's shape): one embedding per input (a text, a list of token ids,
or a list of either), pooled as the engine's pooler_config says (pooling_params.py), batched by
the scheduler with everything else. `encoding_format` "float" (lists of numbers) or "base64"
(little-endian float32 bytes, as OpenAI's client decodes them); `dimensions` truncates and
re-normalizes; vLLM's `normalize` may turn normalization off. Anything else is refused by name.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictInt, field_validator

from tokenmill.outputs import EmbeddingRequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.protocol import Prompt, StrictModel, Text, check_prompt, prompt_list
from tokenmill.server.serving_common import OpenAIServing, RequestFailed, collect


class EmbeddingRequest(StrictModel):
    model: Text | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: Text | None = None
    normalize: StrictBool | None = None  # vLLM's extra field

    @field_validator("input", mode="plain")
    @classmethod
    def _input(cls, value: Any) -> Prompt:
        return check_prompt(value, "input")


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> JSONResponse:
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        prompts = prompt_list(req.input)
        ticket = self.admission.admit(len(prompts))
        try:
            gens = await self.add_all(prompts, params, None)
            finals: list[EmbeddingRequestOutput] = await collect(gens, raw)
        finally:
            ticket.release()
        data = []
        for i, out in enumerate(finals):
            if out.error is not None:
                raise RequestFailed(f"the engine failed on this request: {out.error}")
            data.append({"object": "embedding", "index": i,
                         "embedding": _encode(out.outputs.embedding, req.encoding_format)})
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return JSONResponse({"id": self.response_id("embd"), "object": "list",
                             "created": int(time.time()), "model": self.model_name,
                             "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encode(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
