"""The scheduler's part of the config factory: step sizes by device and use, and whether steps
run ahead (async scheduling). config_factory.create_engine_config calls them; like it, they
read the device's properties but no file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.config import ModelConfig, SchedulerConfig
from tokenmill.distributed.config import ParallelConfig
from tokenmill.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from tokenmill.engine_args import EngineArgs


def scheduler_config(args: EngineArgs, model: ModelConfig, async_scheduling: bool,
                     device: str, offline: bool) -> SchedulerConfig:
    """The scheduler's options as asked, the step sizes not asked by device and use, and the
    budget checked against the model's length when prefill is not chunked."""
    options = args.group("scheduler") | {"async_scheduling": async_scheduling}
    default_budget, default_seqs = scheduler_defaults(device, offline)
    if options["max_num_seqs"] is None:
        options["max_num_seqs"] = default_seqs
    budget = options.pop("max_num_batched_tokens")
    if budget is None:
        # Without chunking a whole prompt must fit in one step (vLLM's rule too).
        budget = default_budget
        if not options["enable_chunked_prefill"]:
            budget = max(model.max_model_len, budget)
    elif not options["enable_chunked_prefill"] and budget < model.max_model_len:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len "
                         f"({model.max_model_len}) when chunked prefill is off")
    return SchedulerConfig(max_num_batched_tokens=budget, **options)


# vLLM's defaults on CUDA (vllm/engine/arg_utils.py), (max_num_batched_tokens, max_num_seqs)
# by (a GPU of 70 GiB or more but an A100, the offline LLM rather than a server)
_CUDA_SCHEDULER_DEFAULTS = {(True, True): (16384, 1024), (True, False): (8192, 1024),
                            (False, True): (8192, 256), (False, False): (2048, 256)}


def scheduler_defaults(device: str, offline: bool) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) where not asked: on CUDA vLLM's, by the GPU's
    memory and by use (the offline LLM takes larger steps than a server, whose steps bound its
    streams' latency); on CPU SchedulerConfig's (2048, 256) for both."""
    if not device.startswith("cuda"):
        return SchedulerConfig.max_num_batched_tokens, SchedulerConfig.max_num_seqs
    props = torch.cuda.get_device_properties(torch.device(device))
    large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
    return _CUDA_SCHEDULER_DEFAULTS[large, offline]


def resolve_async_scheduling(asked: bool | None, device: str,
                             speculative: SpeculativeConfig | None,
                             parallel: ParallelConfig) -> bool:
    """Whether steps are scheduled and prepared while the one before runs: as asked, or by
    default (vLLM's: on where it runs) on CUDA with one rank, where the host's work for a
    step then hides behind the device's. Off by default on CPU: the forward pass already
    takes every core, and on 2 cores the overlap measured within noise (RESULTS.md,
    thirteenth and fourteenth sessions)."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"async_scheduling must be True or False, got {asked!r}")
    blocked = speculative is not None or parallel.pipeline_parallel_size > 1
    if asked and blocked:
        raise ValueError("async_scheduling does not run with speculative decoding or "
                         "pipeline_parallel_size > 1 yet")
    if asked is None:
        return device.startswith("cuda") and parallel.tensor_parallel_size == 1 and not blocked
    return asked
