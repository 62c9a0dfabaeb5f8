"""The fused CPU layers call (models/cpu_decode.py) against the modules' own forward: the same
greedy tokens and bitwise the same logprobs, for dense and quantized weights, taken exactly
where it applies (layers stating only ops the call computes, steps of the CPU paged kernel,
decodes and prefill chunks, no larger than every linear's stated kernel takes), declining
anything else."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_kv_all_free, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.models import cpu_decode
from tokenmill.models.cpu_decode import FusedLayers

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def run(path: str, prompts: list[list[int]], quantization: str | None = None,
        kv_cache_dtype: str = "auto"):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    method, _, acts = (quantization or "").partition("+")
    llm = LLM(path, quantization=method or None, int8_activations=acts == "int8acts",
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def with_random_norms_and_biases(folder: str, out) -> str:
    """A copy of a tiny model whose norm weights and biases are random, not ones and zeros
    (which would hide a path that swaps norms or drops biases)."""
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if "norm" in name or name.endswith("bias"):
            weights[name] = t + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


# qwen2: q/k/v biases; qwen3: per-head q/k norm (its own spec: "attention.qk_norm"); qwen3_moe:
# the same attention with experts; olmoe: q/k norms over all heads, q/k/v clamped, experts.
# mixtral: an MoE block (router, experts) in place of the MLP; qwen2_moe: with a shared
# expert, top-k not renormalized, and a dense layer among them.
# int8 / int4: quantized weights take the same fused call through their method objects;
# bfloat16 / float16 / int8 / fp8 KV caches: the call stores and reads them with the same kernels as
# the modules.
@pytest.mark.parametrize("kind,quantization,kv", [
    ("llama", None, "auto"), ("qwen2", None, "auto"), ("qwen3", None, "auto"),
    ("llama", "int8", "auto"), ("qwen2", "int4", "auto"), ("llama", "int4+int8acts", "auto"),
    ("llama", None, "int8"), ("qwen2", "int8", "fp8"), ("llama", None, "bfloat16"),
    ("qwen2", None, "float16"),
    ("mixtral", None, "auto"), ("mixtral", "int8", "auto"), ("qwen2_moe", None, "auto"),
    ("qwen3_moe", None, "auto"), ("qwen3", "int8", "int8"), ("olmoe", None, "auto")])
def test_same_outputs_as_module_path(kind, quantization, kv, tiny_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = with_random_norms_and_biases(tiny_model(kind)[0], tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(1)
    # 3 prompts: decode steps of 3, then fewer; one alone (batch 1).
    batch = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 40)]
    single = [[rng.randrange(3, 49152) for _ in range(23)]]
    fused_calls = _counting_fused_calls(monkeypatch)
    fast = run(path, batch, quantization, kv) + run(path, single, quantization, kv)
    # batch-1 and batch-3 decode steps took the call, and so did the 23-token prefill step
    assert set(fused_calls) >= {1, 3, 23}
    monkeypatch.setattr(FusedLayers, "applies", lambda self, hidden, meta: False)
    assert run(path, batch, quantization, kv) + run(path, single, quantization, kv) == fast
    if quantization is None and kv == "auto":
        assert [t for t, _ in fast] == [hf_greedy(hf, p, 10) for p in batch + single]


def _counting_fused_calls(monkeypatch) -> list[int]:
    """The token count of every fused decode call from now on."""
    calls: list[int] = []
    real_op = cpu_decode._decode_layers_op()

    def counting_op(hidden, *args):
        calls.append(hidden.shape[0])
        return real_op(hidden, *args)

    monkeypatch.setattr(cpu_decode, "_decode_layers_op", lambda: counting_op)
    return calls


@pytest.mark.parametrize("kind", ["llama-gelu", "qwen2-gelu-tanh"])
def test_gelu_models_decode_through_the_fused_call(kind, tiny_model, tmp_path, monkeypatch):
    """An MLP gated by GELU (exact, and tanh with q/k/v biases): the fused call computes the
    activation the config names (it once ran SiLU for every model), takes the decode steps,
    and the tokens are HF's and bitwise the modules' (logprobs included)."""
    from transformers import AutoModelForCausalLM

    path = with_random_norms_and_biases(tiny_model(kind)[0], tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 19, 33, 50)]
    calls = _counting_fused_calls(monkeypatch)
    fast = run(path, prompts[:2]) + run(path, prompts[2:3]) + run(path, prompts[3:])
    assert 1 in calls and 2 in calls  # batch-1 and batch-2 decode steps took the call
    assert [t for t, _ in fast] == [hf_greedy(hf, p, 10) for p in prompts]
    monkeypatch.setattr(FusedLayers, "applies", lambda self, hidden, meta: False)
    assert run(path, prompts[:2]) + run(path, prompts[2:3]) + run(path, prompts[3:]) == fast


def test_steps_a_stated_kernel_does_not_take_run_the_modules(tiny_model, monkeypatch):
    """Without batch invariance a float32 weight goes through the C++ kernel it states only in
    steps of up to cpu_ops.SMALL_M rows (larger ones take oneDNN's prepacked copy): the call
    takes the decode steps and leaves the 21-token prefill to the modules; batch-invariant,
    the same model's prefill takes the call. Greedy output is HF's either way."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(40, 61)), list(range(70, 73))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    calls = _counting_fused_calls(monkeypatch)
    for invariant in (False, True):
        calls.clear()
        llm = LLM(path, batch_invariant=invariant)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
        assert 2 in calls  # the decode steps of both
        assert (max(calls) > cpu_ops.SMALL_M) == invariant, calls


def test_a_subclass_that_redefines_forward_states_nothing(tiny_model):
    """The plan comes from what modules state (layers/op_spec.py): a subclass that redefines
    a method its spec describes states nothing, so the call declines; one that only inherits
    computes the same thing and keeps it."""
    from tokenmill.layers.op_spec import spec_of
    from tokenmill.models.llama import LlamaMLP

    class SameMLP(LlamaMLP):
        pass

    class ScaledMLP(LlamaMLP):
        def forward(self, x):
            return super().forward(x) * 2.0

    llm = LLM(tiny_model("llama")[0])
    model = llm.engine.runner.model.model
    assert model.fused_layers._plan is not None
    mlp = model.layers[1].mlp
    mlp.__class__ = SameMLP
    assert spec_of(mlp) is not None
    assert FusedLayers(model.layers, model.rotary_embs)._plan is not None
    mlp.__class__ = ScaledMLP
    assert spec_of(mlp) is None and spec_of(model.layers[1]) is None
    assert FusedLayers(model.layers, model.rotary_embs)._plan is None


def test_a_spec_the_call_does_not_compute_makes_it_decline(tiny_model, monkeypatch):
    """A module stating an op variant the C++ side lacks (a made-up activation, relu(g)^2 *
    up) turns the call off: the decode steps run the modules, which compute it, and the
    tokens follow the module's own arithmetic, not a substitute."""
    from torch import nn

    from tokenmill.layers.op_spec import OpSpec

    class ReluSquaredAndMul(nn.Module):
        computes = ("forward",)

        def forward(self, x):
            gate, up = x.chunk(2, dim=-1)
            return torch.relu(gate) ** 2 * up

        def op_spec(self):
            return OpSpec("gated_act", frozenset({"relu_squared"}))

    assert "gated_act.relu_squared" not in cpu_decode.implemented_ops()
    assert "gated_act.silu" in cpu_decode.implemented_ops()
    path = tiny_model("llama")[0]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    calls = _counting_fused_calls(monkeypatch)
    llm = LLM(path)
    for layer in llm.engine.runner.model.model.layers:
        layer.mlp.act_fn = ReluSquaredAndMul()
    made_up = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls == []  # every decode step declined the call
    assert llm.engine.runner.model.model.fused_layers._plan is None
    plain = [o.outputs[0] for o in LLM(path).generate(prompts, params, use_tqdm=False)]
    assert calls  # the same model with SiLU takes it
    # the modules computed the made-up activation: other logits than SiLU's
    assert [c.logprobs for c in made_up] != [c.logprobs for c in plain]


@pytest.mark.parametrize("invariant", [True, False])
def test_fused_path_with_a_shared_prefix(tiny_model, monkeypatch, invariant):
    """Decode steps of sequences sharing a cached prompt (prefix caching): every query still
    goes to the paged kernel, whose work items read the shared blocks once for all of them,
    so the fused call takes those steps too. Greedy output matches HF."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    steps = []
    real_op = cpu_decode._decode_layers_op()

    def counting_op(*args):
        steps.append(args[0].shape[0])  # the step's tokens
        return real_op(*args)

    monkeypatch.setattr(cpu_decode, "_decode_layers_op", lambda: counting_op)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 49152) for _ in range(80)]  # 5 blocks of 16, shared
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(3)] for _ in range(4)]
    llm = LLM(path, block_size=16, batch_invariant=invariant)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    steps.clear()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert steps.count(4) >= 7  # the four sharing sequences' decode steps, fused
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    assert_kv_all_free(llm.engine)


def _tp_rank_main(rank: int, world: int, path: str, init: str, shm_path: str, q) -> None:
    """One tensor-parallel rank: a decode step through the fused call and through the
    modules, on the same inputs (the second run rewrites the same K/V into the same slot)."""
    from tokenmill.attention.input_batch import InputBatch
    from tokenmill.core.interface import (
        NewRequestData,
        RequestStep,
        ScheduledRequest,
        SchedulerOutput,
    )
    from tokenmill.distributed import ParallelState
    from tokenmill.distributed.shm_all_reduce import ShmAllReduce
    from tokenmill.engine_args import engine_config
    from tokenmill.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank,
                                         world_size=world)
    comm = ShmAllReduce(shm_path, rank, world)
    runner = ModelRunner(engine_config(path, num_kv_blocks=32),
                         ParallelState(rank, world, comm))
    prompt, params = list(range(100, 121)), SamplingParams(temperature=0)
    runner.execute(SchedulerOutput(scheduled=[RequestStep("a", 0, len(prompt), True)],
                                   new_requests=[NewRequestData("a", prompt, [], params,
                                                                [1, 2])]))
    batch = InputBatch.build([ScheduledRequest("a", [7], len(prompt), [1, 2], True, params)],
                             runner.block_size, runner.device)
    meta = runner.backend.build_metadata(batch)
    model = runner.model
    fused_path = model.model.fused_layers
    with torch.inference_mode():
        applies = fused_path.applies(model.model.embed_tokens(batch.input_ids), meta)
        fused = model(batch.input_ids, batch.positions, meta)
        fused_path.enabled = False
        modules = model(batch.input_ids, batch.positions, meta)
    q.put((rank, applies, fused.numpy(), modules.numpy()))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_call_under_tensor_parallelism(kind, tiny_model, tmp_path):
    """TP=2 with the shared-memory all-reduce: each rank's decode step takes the fused call,
    which sums the row-parallel outputs itself, bitwise equal to its modules (qwen2: q/k/v
    biases on the column-parallel side only, so it is admitted)."""
    import multiprocessing as mp
    import os

    from tokenmill.distributed import shm_all_reduce

    path = with_random_norms_and_biases(tiny_model(kind)[0], tmp_path / kind)
    ctx, world = mp.get_context("spawn"), 2
    shm_path = shm_all_reduce.create_segment(world)
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank_main,
                         args=(r, world, path, f"file://{tmp_path}/rdv", shm_path, q))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    finally:
        os.unlink(shm_path)
    for rank, applies, fused, modules in results:
        assert applies, rank
        assert (fused == modules).all(), rank
    assert (results[0][2] == results[1][2]).all()  # every rank holds the same hidden states


def test_the_runner_not_the_model_attaches_the_fused_call(tiny_model):
    """A loaded model declares its layers only; the runner gives its stack the fused call."""
    from tokenmill.engine_args import engine_config
    from tokenmill.model_loader.loader import load_model

    path = tiny_model("llama")[0]
    model = load_model(engine_config(path).model, torch.device("cpu"))
    assert model.model.fused_layers is None
    runner_model = LLM(path).engine.runner.model
    assert isinstance(runner_model.model.fused_layers, FusedLayers)
    assert runner_model.model.fused_layers._plan is not None
