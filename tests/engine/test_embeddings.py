"""Embeddings (pooling_params.py, worker/pooler.py, engine/pooled_outputs.py): LLM.embed equals
Hugging Face's last hidden state pooled (last token or mean) and L2-normalized, on tiny
random-weight models, under chunked prefill, preemption and (for last-token pooling)
prefix-cache hits; embedding and generating requests share the scheduler's batches, each
answered as alone; bad fields fail alone with the field named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM, PoolingParams, SamplingParams


@torch.no_grad()
def hf_embedding(hf, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # (P, H), after the norm
    v = hidden[-1] if pooling == "LAST" else hidden.mean(0)
    return F.normalize(v, dim=-1) if normalize else v


def run_all(engine, embeds: list[list[int]], gens: list[tuple[list[int], int]]) -> dict:
    """Greedy generating and embedding requests added at once (in that order), stepped to the
    end."""
    for i, (p, m) in enumerate(gens):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=m,
                                                      ignore_eos=True))
    for i, p in enumerate(embeds):
        engine.add_request(f"e{i}", p, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("kind, pooling", [("qwen3", "LAST"), ("qwen3", "MEAN"),
                                           ("llama", "MEAN"), ("gemma3", "LAST")])
def test_embed_equals_hf_under_chunking_preemption_and_prefix_hits(tiny_model, kind, pooling):
    """Generating requests beside them grow until the cache runs out: requests are preempted
    (embedding ones too, whose pooling then restarts from their first position)."""
    path, hf = tiny_model(kind)
    prompts = [p for p, _ in mixed_prompts(8, hf.config.vocab_size, seed=6, max_len=150)]
    gens = mixed_prompts(4, hf.config.vocab_size, seed=3, max_len=100, max_new=64)
    llm = LLM(path, pooler_config={"pooling_type": pooling},
              num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    engine = llm.engine
    victims = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: victims.append(r.pooling_params is not None) \
        or preempt(r)
    try:
        done = run_all(engine, prompts, gens)
        assert True in victims  # an embedding request was preempted (and recomputed)
        again = [prompts[4], prompts[4] + [5, 6, 7]]  # the second shares 16 blocks
        outs_again = llm.embed(again[:1], use_tqdm=False) + llm.embed(again[1:], use_tqdm=False)
        # last-token pooling reads one position: cache hits may skip the rest; mean pooling
        # needs every position computed
        assert (engine.kv.prefix_hits > 0) == (pooling == "LAST")
        assert_kv_all_free(engine)
    finally:
        engine.shutdown()
    outs = [done[f"e{i}"] for i in range(len(prompts))] + outs_again
    for prompt, out in zip(prompts + again, outs, strict=True):
        assert out.finished and out.error is None and out.prompt_token_ids == prompt
        expected = hf_embedding(hf, prompt, pooling)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected,
                                   rtol=0, atol=2e-5)
    for i, (p, m) in enumerate(gens):
        assert done[f"g{i}"].outputs[0].token_ids == hf_greedy(hf, p, m)


def test_dimensions_and_normalize(tiny_model):
    path, hf = tiny_model("qwen3")
    prompt = mixed_prompts(3, hf.config.vocab_size, seed=7, max_len=40)[2][0]
    llm = LLM(path)  # runner "auto": embeds and generates
    raw, short = llm.embed([prompt, prompt], [PoolingParams(normalize=False),
                                               PoolingParams(dimensions=16)], use_tqdm=False)
    full = hf_embedding(hf, prompt, "LAST", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), full, rtol=0, atol=2e-5)
    torch.testing.assert_close(torch.tensor(short.outputs.embedding),
                               F.normalize(full[:16], dim=-1), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="dimensions \\(65\\) exceeds the model's embedding "
                                         "size 64"):
        llm.embed([prompt], PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert_kv_all_free(llm.engine)


def test_embedding_and_generation_share_steps(tiny_model):
    """Both kinds in the same steps of one engine: generated tokens == HF greedy, embeddings
    == HF's."""
    path, hf = tiny_model("llama")
    cases = mixed_prompts(6, hf.config.vocab_size, seed=8, max_len=100, max_new=16)
    llm = LLM(path, max_num_batched_tokens=48)
    engine = llm.engine
    mixed_steps = []
    real_step = engine.step

    def watching_step():
        kinds = {r.pooling_params is None for r in engine.scheduler.running}
        mixed_steps.append(kinds == {True, False})
        return real_step()

    engine.step = watching_step
    done = run_all(engine, [p for p, _ in cases], cases)
    assert any(mixed_steps)
    for i, (p, m) in enumerate(cases):
        assert done[f"g{i}"].outputs[0].token_ids == hf_greedy(hf, p, m)
        torch.testing.assert_close(torch.tensor(done[f"e{i}"].outputs.embedding),
                                   hf_embedding(hf, p, "LAST"), rtol=0, atol=2e-5)
    assert_kv_all_free(engine)


def test_runner_choice_is_enforced(tiny_model):
    path, _ = tiny_model("llama")
    gen = LLM(path, runner="generate")
    with pytest.raises(ValueError, match="runner='pooling' or 'auto' to compute embeddings"):
        gen.embed(["hello"])
    assert generate_greedy(gen, [([5, 6, 7], 2)])[0]
    emb = LLM(path, runner="pooling")
    with pytest.raises(ValueError, match="does not generate"):
        emb.generate(["hello"])
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN"):
        LLM(path, pooler_config={"pooling_type": "CLS"})
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(path, runner="embed")


@pytest.mark.parametrize("config_cls", ["Qwen3Config", "MistralConfig"])
def test_base_model_checkpoint_embeds(tokenizer_dir, tmp_path, config_cls):
    """A transformers `*Model` checkpoint (no LM head; names without "model.", as e5-mistral
    and gte-Qwen2 ship) loads for embeddings only: runner auto becomes pooling, the
    embeddings equal HF's AutoModel, generation is refused by name."""
    import shutil

    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    llm = LLM(str(tmp_path), max_num_batched_tokens=32)
    assert llm.engine.config.runner == "pooling"
    prompts = [p for p, _ in mixed_prompts(4, 49152, seed=15, max_len=90)]
    outs = llm.embed(prompts, use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(["hi"])
    llm.engine.shutdown()
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = F.normalize(base(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(str(tmp_path), runner="generate")
