"""vLLM's runtime LoRA routes, served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (absent,
they are 404 as in vLLM): `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.
The adapters themselves: server/lora_modules.py."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.lora.request import LoRARequest
from tokenmill.server.routes import check_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; the name decides


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> str:
    adapters = raw.app.state.server.adapters
    lora = LoRARequest(req.lora_name, 1, req.lora_path)  # the id is the server's to give
    await asyncio.get_running_loop().run_in_executor(None, adapters.add, lora)
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request) -> str:
    raw.app.state.server.adapters.remove(req.lora_name)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
