"""Sleep mode (vLLM's `--enable-sleep-mode`): an idle runner gives its memory back and takes it
again on wake.

- level 1: the KV cache is released and the weights leave the serving memory: on CUDA they
  are moved to host memory (and back on wake); on CPU, where host memory is the serving
  memory, they are dropped and read again from the checkpoint on wake (a GGUF or
  safetensors file is memory-mapped: the page cache usually still holds it).
- level 2: the KV cache and the weights are released everywhere; wake reads the checkpoint.

On wake the KV cache comes back with the same number of blocks (the scheduler's view does not
change), attention is bound again, and what hangs on the weights is rebuilt: LoRA slots
(adapters load again on demand), the draft model, CUDA graphs. KV tiers below the cache keep
their blocks. Freed CPU heap memory is handed back to the OS (glibc's malloc_trim), so that
the process's RSS shows the release. The engine sleeps only while no request is in flight
(engine/llm_engine.py), so no request state is lost.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

from tokenmill.lora.manager import LoRAManager
from tokenmill.utils.heap import trim_heap

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def release(runner: ModelRunner, level: int) -> None:
    """Give back the KV cache and the weights (see the module doc)."""
    t0 = time.perf_counter()
    runner.decode_graphs = None
    runner.drafter = None
    runner.lora = None
    for attn in runner.model.attention_layers():
        attn.kv_cache = None
    runner.kv_cache = runner.swap_cache = None
    if level == 1 and runner.device.type == "cuda":
        runner.model.to("cpu")  # back on wake
    else:
        runner.model = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    trim_heap()
    logger.info("asleep (level %d): KV cache and weights released in %.1f s", level,
                time.perf_counter() - t0)


def restore(runner: ModelRunner) -> None:
    """Take the weights and the KV cache again, as they were at start-up."""
    t0 = time.perf_counter()
    config = runner.config
    if runner.model is None:
        runner._load_model()
    else:
        runner.model.to(runner.device)
    if config.lora is not None:
        runner.lora = LoRAManager(runner.model, config.lora, runner.device)
    runner._allocate_kv(runner.num_kv_blocks)
    runner._bind_attention()
    runner._load_drafter()
    runner._capture_graphs()
    logger.info("awake: weights and KV cache back in %.1f s", time.perf_counter() - t0)
