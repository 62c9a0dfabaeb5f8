"""Multi-LoRA serving end to end, against peft's merged models in float32: greedy tokens equal
for every adapter in mixed batches (base requests beside adapters, more adapters than
max_loras), under chunked prefill, preemption (recompute and swap), n > 1, speculative
decoding and int8 base weights; the prefix cache keyed by the adapter's identity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_kv_all_free
from tests.lora.conftest import edited_copy
from tokenmill import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from tokenmill.lora.request import LoRARequest as LoRARequestByVLLMPath

NAMES = ["qv8", "all4", "mlp16", "ko2"]


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 40000 + 100 for j in range(5 + 9 * i)] for i in range(n)]


def _requests(adapters, names):
    return [None if name is None else
            LoRARequest(name, i + 1, adapters.paths[name]) for i, name in enumerate(names)]


def _greedy(llm, prompts, loras, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def _expected(adapters, prompts, names, max_tokens=10):
    return [adapters.reference(name, p, max_tokens) for p, name in zip(prompts, names, strict=True)]


def test_vllm_import_path():
    assert LoRARequestByVLLMPath is LoRARequest
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


# a mixed batch: the base model and four adapters (two slots), interleaved
MIXED = [None, "qv8", "all4", None, "mlp16", "ko2", "qv8", "all4", "ko2", "mlp16"]


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill: chunks meet adapters mid-prompt
    dict(num_kv_blocks=14, block_size=8),  # preemption by recomputation
    dict(num_kv_blocks=14, block_size=8, preemption_mode="swap", swap_space="4MiB"),
], ids=["plain", "chunked", "preempt", "swap"])
def test_mixed_adapters_match_peft(adapters, options):
    prompts = _prompts(len(MIXED))
    expected = _expected(adapters, prompts, MIXED)
    assert len({tuple(e) for e in expected}) == len(expected)  # the adapters change tokens
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, **options)
    assert _greedy(llm, prompts, _requests(adapters, MIXED)) == expected
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(llm.engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_adapters_match_peft_on_cuda(adapters):
    """The same adapter objects on CUDA (lora/layers.py's torch ops; benchmarks/gpu_session.sh
    runs it): a mixed batch of base requests and more adapters than slots, greedy as peft's
    merged models on the CPU."""
    prompts = _prompts(len(MIXED))
    llm = LLM(adapters.base_path, dtype="float32", device="cuda", enable_lora=True, max_loras=2,
              max_lora_rank=16)
    assert _greedy(llm, prompts, _requests(adapters, MIXED)) == _expected(adapters, prompts, MIXED)
    assert_kv_all_free(llm.engine)


def test_one_adapter_for_every_prompt_and_n_samples(adapters):
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_lora_rank=16)
    prompts = _prompts(3)
    lora = LoRARequest("all4", 1, adapters.paths["all4"])
    assert _greedy(llm, prompts, lora) == _expected(adapters, prompts, ["all4"] * 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    out = llm.generate(prompts[1], params, use_tqdm=False, lora_request=lora)[0]
    want = adapters.reference("all4", prompts[1], 8)
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert_kv_all_free(llm.engine)


def test_speculative_decoding_verifies_with_the_adapter(adapters):
    """n-gram drafts are verified by the model with the request's adapter: greedy output is the
    adapter's."""
    prompt = [500 + (i % 7) for i in range(40)]  # repetitive: the n-gram drafter proposes
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_lora_rank=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    names = ["qv8", None]
    got = _greedy(llm, [prompt, prompt], _requests(adapters, names), 12)
    assert got == _expected(adapters, [prompt, prompt], names, 12)
    assert_kv_all_free(llm.engine)


def test_prefix_cache_is_keyed_by_the_adapters_identity(adapters, tmp_path):
    prompt = list(range(1000, 1100))
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, block_size=16)
    kv = llm.engine.kv

    def run(lora):
        before = kv.prefix_hits
        assert _greedy(llm, [prompt], [lora], 4) == [adapters.reference(
            None if lora is None else NAME_OF[lora.lora_path], prompt, 4)]
        return kv.prefix_hits - before

    a = LoRARequest("qv8", 1, adapters.paths["qv8"])
    # the same folder under another name and id, and another adapter reusing id 1
    copy = tmp_path / "renamed"
    shutil.copytree(adapters.paths["qv8"], copy)
    renamed = LoRARequest("renamed", 7, str(copy))
    other = LoRARequest("other", 1, adapters.paths["all4"])
    NAME_OF = {adapters.paths["qv8"]: "qv8", str(copy): "qv8", adapters.paths["all4"]: "all4"}
    assert run(a) == 0
    assert run(a) == 96  # the same adapter: its blocks
    assert run(None) == 0  # the base model: never the adapter's K/V
    assert run(other) == 0  # the same int id, another adapter
    assert run(renamed) == 96  # another name for the same weights
    assert_kv_all_free(llm.engine)


def test_int8_base_weights_keep_the_adapter_beside_them(adapters):
    """int8 weights with a float32 adapter: the adapter changes the output, and a request's
    tokens do not depend on what shares its step."""
    llm = LLM(adapters.base_path, quantization="int8", enable_lora=True, max_loras=2,
              max_lora_rank=16)
    prompts = _prompts(4)
    names = ["all4", None, "qv8", "all4"]
    mixed = _greedy(llm, prompts, _requests(adapters, names))
    alone = [_greedy(llm, [p], _requests(adapters, [n]))[0]
             for p, n in zip(prompts, names, strict=True)]
    assert mixed == alone
    base = _greedy(llm, [prompts[0]], [None])[0]
    assert mixed[0] != base


def test_bad_adapters_fail_alone(adapters, tmp_path):
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def refused(lora, match):
        with pytest.raises(ValueError, match=match):
            llm.generate([1, 2, 3], params, use_tqdm=False, lora_request=lora)

    refused(LoRARequest("big", 1, adapters.paths["mlp16"]), "rank 16 exceeds max_lora_rank=8")
    refused(LoRARequest("nowhere", 1, str(tmp_path / "missing")), "not a folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(LoRARequest("empty", 1, str(empty)), "no adapter_config.json")
    for field, value, match in [("modules_to_save", ["lm_head"], "modules_to_save"),
                                ("use_dora", True, "use_dora"), ("bias", "all", "bias")]:
        folder = tmp_path / field
        shutil.copytree(adapters.paths["qv8"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | {field: value}))
        refused(LoRARequest(field, 1, str(folder)), match)
    refused(LoRARequest("embed", 1, str(_with_tensor(
        adapters.paths["qv8"], tmp_path / "embed",
        "base_model.model.model.embed_tokens.lora_embedding_A", (8, 49152)))),
        "embedding adapter")
    refused(LoRARequest("deep", 1, str(_with_tensor(
        adapters.paths["qv8"], tmp_path / "deep",
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", (8, 64),
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight", (64, 8)))),
        "does not have")
    refused(LoRARequest("wide", 1, str(_with_tensor(
        adapters.paths["qv8"], tmp_path / "wide",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (8, 256)))),
        "another base model")
    # served on after every refusal, with every block free
    assert _greedy(llm, [[5, 6, 7]], [LoRARequest("qv8", 1, adapters.paths["qv8"])], 4) == \
        [adapters.reference("qv8", [5, 6, 7], 4)]
    assert_kv_all_free(llm.engine)
    plain = LLM(adapters.base_path, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([1, 2], params, use_tqdm=False,
                       lora_request=LoRARequest("qv8", 1, adapters.paths["qv8"]))


def _with_tensor(src: str, dst, *entries) -> object:
    """A copy of adapter folder `src` with tensors (name, shape, name, shape, ...) set."""
    pairs = dict(zip(entries[::2], entries[1::2], strict=True))
    return edited_copy(src, dst,
                       lambda t: t | {name: torch.randn(shape) for name, shape in pairs.items()})


def test_bin_weights_and_chat(adapters, tmp_path):
    """adapter_model.bin (torch.save) serves as the safetensors file does; chat takes
    lora_request too."""
    from safetensors.torch import load_file

    folder = tmp_path / "as-bin"
    folder.mkdir()
    shutil.copy(f"{adapters.paths['ko2']}/adapter_config.json", folder)
    torch.save(load_file(f"{adapters.paths['ko2']}/adapter_model.safetensors"),
               folder / "adapter_model.bin")
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True)
    prompt = [21, 22, 23, 24]
    assert _greedy(llm, [prompt], [LoRARequest("bin", 1, str(folder))], 6) == \
        [adapters.reference("ko2", prompt, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": "hi"}]
    with_adapter = llm.chat(messages, params, use_tqdm=False,
                            lora_request=LoRARequest("bin", 1, str(folder)))
    base = llm.chat(messages, params, use_tqdm=False)
    assert with_adapter[0].prompt_token_ids == base[0].prompt_token_ids
    assert with_adapter[0].outputs[0].token_ids != base[0].outputs[0].token_ids


def test_unsupported_architecture_is_refused_at_start(tiny_model):
    path = tiny_model("mixtral")[0]
    with pytest.raises(ValueError, match="not served for MixtralForCausalLM"):
        LLM(path, enable_lora=True)


def test_tensor_parallel_shards_the_adapters_as_the_layers(adapters):
    """TP = 2: A split along the input of row-parallel layers (o, down), B along the output of
    column-parallel ones (q/k/v, gate/up): the same tokens as peft's merged model."""
    names = ["all4", None, "mlp16", "ko2"]
    prompts = _prompts(len(names))
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, tensor_parallel_size=2)
    try:
        assert _greedy(llm, prompts, _requests(adapters, names)) == \
            _expected(adapters, prompts, names)
        assert_kv_all_free(llm.engine)
    finally:
        llm.engine.shutdown()


def test_structured_outputs_constrain_an_adapters_tokens(adapters):
    """A grammar constrains what the adapter's logits choose: valid JSON of the schema, and
    other text than the base model's under the same grammar."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(json=schema))
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_lora_rank=16)
    prompt = [7, 8, 9, 10]
    texts = [o.outputs[0].text for o in llm.generate(
        [prompt, prompt], params, use_tqdm=False,
        lora_request=[LoRARequest("all4", 1, adapters.paths["all4"]), None])]
    for text in texts:
        assert set(json.loads(text)) == {"n"}
    assert texts[0] != texts[1]
    assert_kv_all_free(llm.engine)


def test_a_hub_id_names_an_adapter_from_the_cache(adapters, tmp_path, monkeypatch):
    """lora_path as a Hub id (vLLM's): served from a Hugging Face cache laid out by hand with
    HF_HUB_OFFLINE=1; an id the cache lacks fails naming it."""
    from tests.model_loader.test_hub import MAIN, _lay_out

    folder = Path(adapters.paths["all4"])
    _lay_out(tmp_path / "hub", "org/all4-lora",
             {MAIN: ("main", {f.name: f for f in folder.iterdir() if f.is_file()})})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True)
    prompt = [31, 32, 33]
    assert _greedy(llm, [prompt], [LoRARequest("hub", 1, "org/all4-lora")], 5) == \
        [adapters.reference("all4", prompt, 5)]
    with pytest.raises(ValueError, match="'org/missing-lora' is not in the local Hugging Face"):
        _greedy(llm, [prompt], [LoRARequest("missing", 2, "org/missing-lora")], 2)


def test_kv_tiers_keep_adapters_apart(adapters):
    """The CPU KV tier under adapters: one prompt under two adapters and the base model,
    twice, through a cache that holds about one of them; the second pass is served from the
    tier, each from blocks stored under its own adapter's key, with peft's tokens."""
    names = ["qv8", "all4", None]
    prompt = [(11 * j) % 40000 + 100 for j in range(41)]
    expected = _expected(adapters, [prompt] * 3, names)
    llm = LLM(adapters.base_path, dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, num_kv_blocks=9, block_size=8, kv_offloading_size="4MiB")
    for _ in range(2):
        for name, want in zip(names, expected, strict=True):  # one at a time: evictions
            assert _greedy(llm, [prompt], _requests(adapters, [name])) == [want]
    offload = llm.engine.kv.offload
    assert offload.hit_tokens["cpu"] >= 3 * 40
    assert len(offload.host) >= 3 * 5  # each prefix's 5 blocks under its own key
    assert_kv_all_free(llm.engine)
