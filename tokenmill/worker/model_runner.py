"""ModelRunner: owns the model, the KV cache and the sampler on one device, and executes steps.

`execute(sched_out)` does, in order: the step's diffs applied to the runner's request states
(worker/request_states.py), block copies for copy-on-write, input tensors, attention
metadata (once per step), the forward pass over the flat batch (a CUDA graph replay for a
plain decode step on CUDA: worker/cuda_graphs.py), logits only at
`logits_indices`, sampling, and one host transfer of the sampled ids. `launch(sched_out)`
(async scheduling, one rank) leaves the sampled ids on the device for the next step's inputs
and brings them to the host once that step's forward pass is queued (worker/in_flight.py).

Under tensor parallelism every rank runs one ModelRunner over its shard (the KV cache holds its
share of KV heads); every rank executes the same steps in the same order, since the layers'
collectives pair up across ranks, and only the driver samples: the others compute the logits
(the LM head's gather is a collective) and return an empty output (with async scheduling they
take the driver's sampled tokens, to feed them next step). Under pipeline parallelism a runner
holds its stage's layers and KV cache; it receives the previous stage's hidden states and
sends its own on (distributed/pipeline.py); the driver is the last stage's first rank.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from tokenmill.attention import AttentionMetadata, get_attention_backend
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import (
    allocate_kv_cache,
    allocate_kv_scales,
    bytes_per_block,
    copy_blocks,
    key_rotation,
    swap_blocks,
)
from tokenmill.config import EngineConfig
from tokenmill.core.interface import (
    GrammarOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.distributed import ParallelState, PeerFailed
from tokenmill.distributed.pipeline import recv_from_prev_stage, send_to_next_stage
from tokenmill.kv_offload.ops import OffloadOps
from tokenmill.kv_offload.worker import OffloadWorker
from tokenmill.layers.attention import attention_features
from tokenmill.layers.sampler import Sampler
from tokenmill.lora.manager import LoRAManager
from tokenmill.model_loader.loader import load_model
from tokenmill.models.cpu_decode import attach_fused_layers
from tokenmill.spec_decode.cost_model import measure_spec_costs
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.policy import SpecCosts
from tokenmill.utils import cdiv
from tokenmill.utils.cuda_device import device_current
from tokenmill.utils.file_maps import file_mapped_bytes
from tokenmill.utils.heap import keep_step_memory
from tokenmill.utils.huge_pages import move_parameters_to_huge_pages
from tokenmill.utils.profiling import scope
from tokenmill.worker import sleep_mode
from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.in_flight import InFlightStep
from tokenmill.worker.kv_budget import allocate_swap, num_kv_blocks
from tokenmill.worker.memory_profile import profiled_kv_budget
from tokenmill.worker.pooler import pool_step
from tokenmill.worker.request_states import RequestStates
from tokenmill.worker.step_sampling import prompt_logprobs, sample_step

logger = logging.getLogger(__name__)


class KVBlockOpsError(RuntimeError):
    """A step's block copies or swaps failed: the KV cache is in doubt for every request."""


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: ParallelState = ParallelState()) -> None:
        self.config = config
        self.ps = tp
        self.is_driver = tp.is_driver  # the rank that samples
        # async scheduling under TP: every rank needs the sampled tokens for the next step
        self.share_samples = config.scheduler.async_scheduling and tp.tp_size > 1
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self._load_model()
        # LoRA adapters' slots in the targeted layers (the fused CPU call adds their deltas
        # too; CUDA graphs are not captured with them)
        self.lora = (None if config.lora is None else
                     LoRAManager(self.model, config.lora, self.device))
        self.sampler = Sampler(config.seed, self.device)
        self.memory_profile = None  # CUDA: the profiled step's figures (memory_profile.py)
        self._allocate_kv()
        self._bind_attention()
        self.states = RequestStates()  # the requests' tokens and block tables
        self.in_flight: InFlightStep | None = None  # launched, tokens not yet on the host
        self.num_fed_in_flight = 0  # ids fed on the device from a step in flight
        self._load_speculative()
        self._capture_graphs()
        if self.device.type == "cpu":
            keep_step_memory()  # what a step frees serves the next (utils/heap.py)

    def _capture_graphs(self) -> None:
        """Decode steps as CUDA graphs, where they run."""
        config = self.config
        self.decode_graphs: DecodeGraphs | None = None
        # NOTE: not under TP / PP: a captured step would hold the ranks' collectives (untested)
        if (self.device.type == "cuda" and not config.enforce_eager
                and config.parallel.world_size == 1 and self.lora is None):
            self.decode_graphs = self._decode_graphs(capture=True)
            if self.decode_graphs is not None:
                self.decode_graphs.capture_all()

    def sleep(self, level: int) -> None:
        """Give back the KV cache and the weights while idle (worker/sleep_mode.py)."""
        sleep_mode.release(self, level)

    def wake_up(self) -> None:
        sleep_mode.restore(self)

    def _load_model(self) -> None:
        """This rank's share of the model's weights, on the device, wrapped in the fused CPU
        decode call where it applies."""
        config, mc = self.config, self.config.model
        t0 = time.perf_counter()
        self.model = load_model(mc, self.device, self.ps, prepack=config.prepack_weights,
                                batch_invariant=config.batch_invariant)
        attach_fused_layers(self.model, self.device)
        # this rank's share of the KV heads (all of them at tp 1), for its stage's layers
        self.num_kv_heads = self.model.attention_layers()[0].num_kv_heads
        self.num_layers = len(self.model.attention_layers())
        if self.device.type == "cpu":
            # The weights a decode step streams (dense or quantized) go to huge pages.
            move_parameters_to_huge_pages(self.model)
        logger.info("model weights loaded (%s, %s, weights %s on %s) in %.1f s", mc.path,
                    mc.dtype, mc.quantization or "dense", self.device,
                    time.perf_counter() - t0)

    def _allocate_kv(self, num_blocks: int | None = None) -> None:
        """The KV cache (and its swap space and fp8 scales) of `num_blocks`, or sized from the
        memory budget less the draft model's share (on CUDA: what a profiled step leaves of
        gpu_memory_utilization, worker/memory_profile.py)."""
        config, mc = self.config, self.config.model
        t0 = time.perf_counter()
        draft = config.draft_model
        self._draft_block_bytes = (0 if draft is None else
                                   DraftModelProposer.block_bytes(draft, self.block_size))
        block = bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                mc.head_dim, mc.dtype, config.cache.kv_cache_dtype)
        # a draft model's K/V take a block of their own beside each target block
        per_block = block + self._draft_block_bytes
        if num_blocks is None:  # (sleep mode's restore gives the count it had)
            num_blocks = num_kv_blocks(config, per_block, self.device,
                                       profiled_kv_budget(self, per_block),
                                       file_mapped_bytes(self.model.parameters()))
        self.num_kv_blocks = num_blocks
        self.kv_cache, self.kv_scales, self.key_rotation = self.kv_tensors(num_blocks)
        kv_dtype = config.cache.kv_cache_dtype
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.0f MiB, %s) in %.1f s",
                    num_blocks - 1, self.block_size, (num_blocks - 1) * self.block_size,
                    num_blocks * per_block / 2**20,
                    mc.dtype if kv_dtype == "auto" else kv_dtype, time.perf_counter() - t0)
        self.num_swap_blocks, self.swap_cache = allocate_swap(config, self.kv_cache, block)
        if getattr(self, "offload", None) is None:  # (kept through sleep mode)
            self.offload = (None if config.kv_offload is None
                            else OffloadWorker(config.kv_offload, self.kv_cache))

    def kv_tensors(self, num_blocks: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A KV cache of num_blocks in the configured format, its fp8 per-head scales
        (num_layers, 2, Hkv) (None for the other formats) and a quantized cache's key
        rotation (None for a float cache)."""
        mc, kv_dtype = self.config.model, self.config.cache.kv_cache_dtype
        return (allocate_kv_cache(self.num_layers, num_blocks, self.block_size,
                                  self.num_kv_heads, mc.head_dim, mc.dtype, self.device,
                                  kv_dtype),
                allocate_kv_scales(self.num_layers, self.num_kv_heads, self.device, kv_dtype),
                key_rotation(mc.head_dim, kv_dtype, self.device))

    def _bind_attention(self) -> None:
        """One attention backend for every layer's variant, bound to each layer with its KV
        cache slice."""
        config, mc = self.config, self.config.model
        features = attention_features(self.model.attention_layers())
        if config.batch_invariant:
            features |= {"batch_invariant"}
        self.backend = get_attention_backend(config.attention_backend, self.block_size,
                                             self.device, mc.dtype, features,
                                             mc.max_model_len)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.bind(self.kv_cache[i], self.backend,
                      None if self.kv_scales is None else self.kv_scales[i], self.key_rotation)

    def _load_speculative(self) -> None:
        """The draft model (if one is configured) and the measured costs the speculative
        policy weighs."""
        config = self.config
        self._load_drafter()
        self.spec_costs: SpecCosts | None = None
        if config.speculative is not None:
            self.spec_costs = measure_spec_costs(
                self.model, self.backend, self.block_size, self.device,
                config.speculative.num_speculative_tokens,
                None if self.drafter is None else self.drafter.model)
            logger.info("speculative decoding costs (in decode steps): verifying 1.. drafts "
                        "%s, %.2f per draft-model forward",
                        " ".join(f"{c:.2f}" for c in self.spec_costs.verify_curve[1:]),
                        self.spec_costs.draft_forward)

    def _load_drafter(self) -> None:
        """The draft model of speculative method "draft_model", with its own KV cache."""
        config, draft = self.config, self.config.draft_model
        self.drafter: DraftModelProposer | None = None
        if draft is not None:
            t0 = time.perf_counter()
            self.drafter = DraftModelProposer(draft, self.num_kv_blocks, self.block_size,
                                              self.device, self.backend,
                                              prepack=config.prepack_weights, seed=config.seed,
                                              batch_invariant=config.batch_invariant)
            logger.info("speculative draft model loaded (%s, weights %s) in %.1f s", draft.path,
                        draft.quantization or "dense", time.perf_counter() - t0)

    def _forward(self, reqs: list[ScheduledRequest], batch: InputBatch,
                 meta: AttentionMetadata, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """The model over the step's flat batch, each request's rows with its LoRA adapter."""
        if self.lora is None:
            return self.model(batch.input_ids, batch.positions, meta, hidden_in)
        self.lora.begin_step(reqs)
        try:
            return self.model(batch.input_ids, batch.positions, meta, hidden_in)
        finally:
            self.lora.end_step()

    def _decode_graphs(self, capture: bool) -> DecodeGraphs | None:
        """Decode steps as CUDA graph replays, where the attention backend provides the static
        state for them (None: it does not, and steps run eagerly)."""
        max_seqs = self.config.scheduler.max_num_seqs
        asked = self.config.cuda_graph_sizes
        state = self.backend.decode_graph_state(
            DecodeGraphs.capture_sizes(max_seqs, asked)[-1],
            cdiv(self.config.model.max_model_len, self.block_size))
        if state is None:
            return None
        return DecodeGraphs(self.model, state, self.device, max_seqs, capture, asked)

    def can_run_ahead(self) -> bool:
        """Whether `launch` leaves a step in flight (worker/in_flight.py): one rank (under TP the
        others need the tokens at once), no draft model (it proposes from them), no KV tiers
        (their step's result rides on the output execute builds)."""
        return (self.ps.tp_size == 1 and self.ps.pp_size == 1 and self.drafter is None
                and self.offload is None)

    @device_current
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None
               ) -> Future[ModelRunnerOutput]:
        """Async scheduling: queue a step and return its output's Future, set once its
        sampled tokens reach the host (by the next launch, after queueing that step's forward
        pass, or by finish_in_flight); the step's error, if it fails, in the Future. Without
        can_run_ahead, the step runs to its end here."""
        prev, done = self.in_flight, Future()
        try:
            if not self.can_run_ahead():
                done.set_result(self.execute(sched, True, grammar))
                return done
            out = self._execute(sched, grammar, defer=True)[0]  # finishes prev
            if isinstance(out, InFlightStep):
                self.in_flight, done = out, out.done
            else:
                done.set_result(out)
        except Exception as e:
            done.set_exception(e)
        finally:
            if self.in_flight is prev:  # this step failed or stopped before its forward pass
                self.finish_in_flight()
        return done

    @device_current
    def finish_in_flight(self) -> None:
        """Bring the step in flight to its end (its tokens to the host)."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            prev.finish()

    @device_current
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ops: bool = True,
                grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step; `grammar`: the bitmasks of its constrained requests (beside it, being
        filled while the forward pass runs). `block_ops=False` skips the step's block copies
        and swaps (the engine re-executes requests of a failed step alone, after those were
        done once).

        Under pipeline parallelism a stage first receives the previous stage's hidden states
        and, last, sends its own to the next stage, or a failure flag when it failed
        (distributed/pipeline.py: one message each way per step, whatever happens)."""
        self.finish_in_flight()
        if self.ps.pp_size == 1:
            out = self._execute(sched, grammar, block_ops)[0]
            if self.offload is not None:
                out.kv_offload = self.offload.take_result()
            return out
        ps, mc = self.ps, self.config.model
        shape = (sched.num_scheduled_tokens, mc.hf_config.hidden_size, mc.dtype, self.device)
        hidden_in = None if ps.is_first_stage else recv_from_prev_stage(ps, *shape)
        failed_upstream = not ps.is_first_stage and shape[0] > 0 and hidden_in is None
        out, hidden = None, None
        try:
            out, hidden = self._execute(sched, grammar, block_ops, hidden_in, failed_upstream)
        finally:
            if not ps.is_last_stage:  # hidden None: this stage failed the step
                send_to_next_stage(ps, hidden, *shape)
        return out

    def _execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None,
                 block_ops: bool = True,
                 hidden_in: torch.Tensor | None = None, failed_upstream: bool = False,
                 defer: bool = False
                 ) -> tuple[ModelRunnerOutput | InFlightStep, torch.Tensor | None]:
        """The step's output, and the hidden states for the next pipeline stage (None on the
        last stage). defer (launch): the step in flight (self.in_flight) is finished after
        this one's forward pass is queued, and this one's sampled tokens are left in flight
        (an InFlightStep instead of the output) where it samples them."""
        req_ids = [r.req_id for r in sched.scheduled]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        with scope("prepare_inputs"):
            offload = self._take_changes(sched, block_ops)
            if failed_upstream:  # after the block ops, which every stage does once
                raise PeerFailed("an earlier pipeline stage failed this step")
            if sched.is_empty:
                return out, None
            reqs = [self.states.resolve(step) for step in sched.scheduled]
            batch = InputBatch.build(reqs, self.block_size, self.device)
            if self.in_flight is not None:
                self.num_fed_in_flight += self.in_flight.feed(batch, reqs)
        with scope("forward"):
            hidden = self.decode_graphs.run(batch) if self.decode_graphs else None
        if hidden is None:  # not a graph replay: the step's metadata, then its forward pass
            with scope("prepare_inputs"):
                meta = self.backend.build_metadata(batch)
            with scope("forward"):
                hidden = self._forward(reqs, batch, meta, hidden_in)  # (T, hidden)
        self.finish_in_flight()  # its tokens, which this step's sampling reads
        if offload:  # a producer's prompt blocks, now computed
            self.offload.publish(offload, self.kv_cache)
        if not self.ps.is_last_stage:
            return out, hidden
        # NOTE: every collective of the step (the LM head's gathers) before the driver's
        # sampling, so that a sampling error on the driver leaves the ranks in step.
        prompt_logprobs(self.model, reqs, batch, hidden, out)
        out.pooled = pool_step(reqs, batch, hidden)  # embedding requests
        if batch.sample_rows:
            with scope("logits"):
                logits = self.model.compute_logits(hidden, batch.logits_indices)  # (S, V)
            if self.share_samples:
                self._sample_and_share(sched, grammar, reqs, batch, logits, out)
            elif self.is_driver:
                deferred = sample_step(self.sampler, sched, grammar, reqs, batch, logits,
                                       out, defer)
                if deferred is not None:  # left in flight
                    rows = batch.sample_rows
                    return InFlightStep.start(out, rows, *deferred, [
                        self.states.requests[out.req_ids[i]].output_token_ids
                        for i in rows]), None
        if self.drafter is not None:
            with scope("draft"):
                out.draft_token_ids, out.draft_probs = self.drafter.propose(
                    reqs, out.sampled_token_ids)
        self.states.append_sampled(req_ids, out.sampled_token_ids)
        return out, None

    def _take_changes(self, sched: SchedulerOutput, block_ops: bool) -> OffloadOps | None:
        """The step's diffs into the request states, the requests that left out of the
        sampler and the drafter, then (block_ops) its block copies and swaps: what the KV
        tiers publish once the step is computed, returned."""
        self.states.update(sched)
        self.sampler.forget(sched.finished_req_ids)
        if self.drafter is not None:  # preempted ones' blocks move: their drafts restart
            self.drafter.forget(sched.finished_req_ids)
            self.drafter.forget(sched.preempted_req_ids, finished=False)
        return self._block_ops(sched) if block_ops else None

    def _block_ops(self, sched: SchedulerOutput) -> OffloadOps | None:
        """The step's block swaps and copies, and its KV tiers' saves and loads (what the
        tiers publish once the step is computed: returned)."""
        offload = sched.kv_offload if self.offload is not None else None
        try:
            if offload:  # evicted blocks out before this step reuses them
                self.offload.save(offload, self.kv_cache)
            swap_blocks(self.kv_cache, self.swap_cache, sched.blocks_to_swap_out,
                        sched.blocks_to_swap_in)
            copy_blocks(self.kv_cache, sched.blocks_to_copy)
            if self.drafter is not None:
                copy_blocks(self.drafter.kv_cache, sched.blocks_to_copy)
            if offload:  # hits from the tiers in
                self.offload.load(offload, self.kv_cache)
        except Exception as e:
            raise KVBlockOpsError(f"{type(e).__name__}: {e}") from e
        return offload

    def _sample_and_share(self, sched: SchedulerOutput, grammar: GrammarOutput | None,
                          reqs: list[ScheduledRequest], batch: InputBatch,
                          logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Async scheduling under TP: the next step is sent before this one's tokens are known,
        so every rank feeds them itself (as a single runner does) and the driver hands them to
        its group: -1s when its sampling failed, and the others then fail the step as
        PeerFailed (one token per sampling row: speculative decoding does not run async)."""
        rows = batch.sample_rows
        tokens = torch.full((len(rows),), -1, dtype=torch.int64)
        try:
            if self.is_driver:
                sample_step(self.sampler, sched, grammar, reqs, batch, logits, out)
                tokens = torch.tensor([out.sampled_token_ids[i][0] for i in rows])
        finally:
            tokens = self.ps.broadcast_from_driver(tokens)
        if not self.is_driver:
            if bool((tokens < 0).any()):
                raise PeerFailed("the driver failed this step's sampling")
            for i, t in zip(rows, tokens.tolist(), strict=True):
                out.sampled_token_ids[i] = [t]
