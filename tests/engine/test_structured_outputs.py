"""Structured outputs through the engine: greedy constrained output equals a reference loop
that masks Hugging Face's logits with llguidance token by token (with and without
jump-forward, under both backends' grammars); the same under speculative decoding, chunked
prefill and preemption, and for each sample of n > 1; sampled constrained tokens follow the
masked distribution; a grammar dead end finishes the request with finish_reason "error";
bad constraints are refused before anything is scheduled; every KV block is freed."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.spec_decode.policy import DRAFT_MODEL_COST, VERIFY_COST_PER_DRAFT, SpecCosts

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                  "maxItems": 3}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA),
             lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=COMPACT)),
    "regex": (StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{2}( [A-Z]+)?"),
              lambda: llguidance.LLMatcher.grammar_from_lark(
                  r"start: /[a-z]{2,6}-[0-9]{2}( [A-Z]+)?/")),
    "choice": (StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"]),
               lambda: llguidance.LLMatcher.grammar_from_lark(
                   'start: "alpha" | "beta gamma" | "delta"')),
    "grammar": (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
                lambda: llguidance.grammar_from("gbnf", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')),
}
PROMPTS = [[1, 504, 3120, 28], [17, 99, 1002, 4000, 8, 8, 8], [5] * 40]


def reference_matcher(tokenizer, grammar: str) -> llguidance.LLMatcher:
    """llguidance's own matcher for `grammar`, independent of the engine's backend code."""
    lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152, eos_token=[2])
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def allowed_by(matcher: llguidance.LLMatcher) -> torch.Tensor:
    """(49152,) bool: the tokens the matcher allows next, from llguidance's bitmask."""
    mask = llguidance.torch.allocate_token_bitmask(1, 49152)
    llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
    return ((mask[0, :, None] >> torch.arange(32)) & 1).view(-1)[:49152].bool()


@torch.no_grad()
def hf_constrained(model: torch.nn.Module, tokenizer, grammar: str, prompt: list[int],
                   max_tokens: int, jump_forward: bool) -> list[int]:
    """Greedy decoding with HF's forward, each step's logits masked by llguidance."""
    matcher = reference_matcher(tokenizer, grammar)
    out: list[int] = []
    while len(out) < max_tokens and not matcher.is_stopped():
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        allowed = allowed_by(matcher)
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token == 2:
            break
        if jump_forward and not matcher.is_stopped():
            for t in matcher.compute_ff_tokens()[:max_tokens - len(out)]:
                out.append(t)
                assert matcher.consume_token(t)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("jump_forward", [False, True])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_matches_masked_hf_reference(tiny, kind, jump_forward):
    path, hf = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=200,
              structured_outputs_config={"jump_forward": jump_forward})
    params, grammar = CONSTRAINTS[kind]
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=params)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_constrained(hf, llm.get_tokenizer(), grammar(), prompt, 40, jump_forward)
        assert out.outputs[0].token_ids == ref
    if jump_forward and kind == "json":
        assert llm.engine.stats().structured_output_jump_forward_tokens > 0  # {"name": forced
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 1}},
    {"speculative_config": {"method": "draft_model", "quantization": "int8",
                            "num_speculative_tokens": 3}},
    {"max_num_batched_tokens": 16},  # chunked prefill; jump-forward chunks too
    {"num_kv_blocks": 12, "block_size": 16},  # preemption (recompute)
    {"async_scheduling": True},  # constrained requests wait for their token in flight
    {"async_scheduling": True, "num_kv_blocks": 12, "block_size": 16},
    {"tensor_parallel_size": 2},  # the masks cross to worker processes beside the step
])
def test_same_output_under_engine_features(tiny, options, monkeypatch):
    path, _ = tiny
    # a tiny draft model costs what its target does: SmolLM2's costs make it draft
    monkeypatch.setattr("tokenmill.worker.model_runner.measure_spec_costs",
                        lambda *args: SpecCosts(VERIFY_COST_PER_DRAFT, DRAFT_MODEL_COST))
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=CONSTRAINTS["json"][0])
    # JSON in the prompt, for n-gram drafts to match; two requests, so that steps stay small
    # enough to verify drafts (SPEC_MAX_STEP_TOKENS)
    example = '{"name": "a", "n": 1, "ok": true, "tags": ["a", "bb"]}\n'
    prompts = [example * 3, "x" + example * 2]
    base = LLM(path, max_model_len=512, num_kv_blocks=200)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, max_model_len=512, **({"num_kv_blocks": 200} | options))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats()
    if "speculative_config" in options:
        assert stats.spec_decode_num_draft_tokens > 0
    if options.get("num_kv_blocks") == 12:
        assert stats.num_preemptions > 0
    assert_kv_all_free(llm.engine)


def test_every_sample_of_n_follows_the_grammar(tiny):
    path, _ = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=200)
    choices = ["alpha", "beta gamma", "delta"]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(n=8, temperature=1.5, seed=3, max_tokens=10,
                                      structured_outputs=StructuredOutputsParams(choice=choices)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 8
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1  # each sample has its own matcher
    assert_kv_all_free(llm.engine)


def test_sampled_tokens_follow_the_masked_distribution(tiny):
    """First tokens drawn under a choice grammar, against the model's softmax renormalised
    over the tokens llguidance allows there (whole words and their prefixes): chi-square, the
    rare tokens pooled."""
    path, hf = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=400)
    words = ["cat", "dog", "sun", "red", "blue"]
    allowed = allowed_by(reference_matcher(llm.get_tokenizer(),
                                           llguidance.grammar_from("choice", words)))
    prompt = [1, 504, 3120]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double()
    expected = torch.softmax(logits.masked_fill(~allowed, float("-inf")) / 2.0, dim=-1)
    n = 3000
    params = SamplingParams(n=n, temperature=2.0, seed=11, max_tokens=1,
                            structured_outputs=StructuredOutputsParams(choice=words))
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    first = torch.tensor([c.token_ids[0] for c in out.outputs])
    assert bool(allowed[first].all())  # no sample left the grammar
    counts = torch.bincount(first, minlength=49152).double()
    big = n * expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([n * expected[big], n * expected[~big].sum()[None]])
    dof = int(big.sum())  # categories - 1 (the pooled one included)
    assert dof >= 3
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp(min=1e-9)).sum())
    limit = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}.get(dof, 3 * dof)
    assert chi2 < limit, (dof, chi2)  # p = 0.001


def test_dead_end_finishes_with_error_reason(tiny):
    """min_tokens bans, as stop ids, every token the grammar allows first: no token is left,
    the request ends at once with finish_reason "error" and the reason, the other goes on."""
    path, _ = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=200)
    allowed = allowed_by(reference_matcher(llm.get_tokenizer(),
                                           llguidance.grammar_from("regex", "cat")))
    first = allowed.nonzero().flatten().tolist()
    assert 1 <= len(first) <= 5  # "c", "ca", "cat"
    dead = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, stop_token_ids=first,
                          structured_outputs=StructuredOutputsParams(regex="cat"))
    fine = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                        [dead, fine], use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "error" and "grammar dead end" in c.stop_reason
    assert len(c.token_ids) == 1
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 20
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("params, message", [
    ({"regex": "[a-"}, "regex"),
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"json": {"type": "string", "format": "idn-email"}}, "idn-email"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
])
def test_bad_constraints_are_refused_before_scheduling(tiny, params, message):
    path, _ = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=200)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=params))
    assert not llm.engine.has_unfinished_requests()


def test_a_repeated_schema_compiles_once(tiny, monkeypatch):
    path, _ = tiny
    llm = LLM(path, max_model_len=512, num_kv_blocks=200)
    backend = llm.engine.structured.backend
    calls = []
    compile_ = backend.compile
    monkeypatch.setattr(backend, "compile", lambda p: calls.append(p) or compile_(p))
    params = [SamplingParams(temperature=0, max_tokens=5, structured_outputs={"json": SCHEMA})
              for _ in range(3)]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert len(calls) == 1
