"""The scheduler's policy objects alone (core/admission.py, spec_policy.py, grammar_policy.py),
each on real parts: a KVCacheManager, the n-gram proposer, a grammar compiled by llguidance on
SmolLM2's tokenizer. The scheduler's own tests (test_scheduler.py) and the engine's run them
together."""

from __future__ import annotations

import pytest

from tokenmill.core.admission import Admission
from tokenmill.core.grammar_policy import GrammarPolicy
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.spec_policy import PROBE_EVERY, SpecPolicy
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode import SpeculativeConfig
from tokenmill.spec_decode.policy import DRAFT_MODEL_INITIAL_ACCEPTANCE, SpecCosts
from tokenmill.structured_output.manager import make_backend
from tokenmill.structured_output.params import StructuredOutputsParams


def make_request(rid: str, prompt: list[int], max_tokens: int = 16, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   [2], max_tokens)


# ---- admission ------------------------------------------------------------------------------
def test_admission_starts_past_the_cached_prefix_and_chunks_to_the_budget():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    admission = Admission(kv, chunked_prefill=True)
    first = make_request("a", list(range(10, 22)))  # 12 tokens: 3 full blocks
    assert admission.admit(first, budget=64) == 12
    first.num_computed_tokens = 12
    kv.free(first)  # its full blocks stay in the prefix cache
    second = make_request("b", list(range(10, 22)) + [40, 41, 42, 43, 44])
    assert admission.admit(second, budget=3) == 3  # chunked to the budget
    assert second.num_computed_tokens == 12  # past the three cached blocks
    assert kv.prefix_hits > 0
    third = make_request("c", list(range(10, 22)) + [50])
    admission.chunked_prefill = False
    assert admission.admit(third, budget=1) == 1  # only its uncached token must fit


def test_admission_without_chunking_waits_for_room_and_keeps_no_block():
    kv = KVCacheManager(16, 4)
    admission = Admission(kv, chunked_prefill=False)
    request = make_request("a", list(range(10)))
    assert admission.admit(request, budget=8) is None
    assert kv.get_block_ids("a") == [] and request.num_computed_tokens == 0
    assert admission.admit(request, budget=10) == 10


def test_admission_gives_no_partial_blocks_when_the_pool_is_short():
    kv = KVCacheManager(3, 4)  # two usable blocks (one is the null block)
    admission = Admission(kv, chunked_prefill=True)
    free = kv.num_free_blocks
    assert admission.admit(make_request("a", list(range(12))), budget=64) is None
    assert kv.num_free_blocks == free == 2


# ---- speculative drafts ---------------------------------------------------------------------
def test_no_speculative_config_gives_nothing():
    spec = SpecPolicy(None)
    request = make_request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    assert spec.drafts(request, 1, room=4, tokens_left=10) == []
    assert spec.lookahead(request, 1, running=1, tokens_left=10) == 0
    spec.on_verified(request, 1)
    assert spec.num_drafts == 0 and request.num_computed_tokens == 0


def test_ngram_drafts_are_bounded_and_verified_drafts_roll_back():
    spec = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                        prompt_lookup_min=2, prompt_lookup_max=3),
                      SpecCosts(0.0, 0.0))  # free verification: every matched draft pays
    request = make_request("a", [7, 8, 9, 7, 8, 9, 7, 8])
    assert spec.drafts(request, 1, room=4, tokens_left=10) == [9, 7, 8]
    assert spec.drafts(request, 1, room=2, tokens_left=10) == [9, 7]  # the step's room
    assert spec.drafts(request, 1, room=4, tokens_left=2) == [9]  # max_tokens
    assert spec.drafts(request, 5, room=4, tokens_left=10) == []  # a prefill chunk
    request.spec_token_ids = [9, 7, 8]
    request.num_computed_tokens = 8 + 3  # the scheduler advanced past the drafts
    spec.on_verified(request, 2)  # one accepted, then one sampled
    assert request.num_computed_tokens == 9 and request.spec_token_ids == []
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 1)
    assert spec.num_accepted_per_pos == [1, 0, 0]
    assert request.spec_acceptance < 0.5  # two of three positions rejected


def test_a_draft_models_lookahead_follows_acceptance_and_probes():
    spec = SpecPolicy(SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                                        model="unused"), SpecCosts(0.0, 0.0))
    request = make_request("a", [1, 2, 3])
    spec.on_add(request)
    assert request.spec_acceptance == DRAFT_MODEL_INITIAL_ACCEPTANCE
    assert spec.lookahead(request, 1, running=1, tokens_left=10) == 0  # after its prompt
    for t in range(3):
        request.append_output_token(t)
    request.num_computed_tokens = request.num_tokens - 1
    assert spec.lookahead(request, 1, running=1, tokens_left=10) == 3
    assert spec.lookahead(request, 1, running=4, tokens_left=10) == 0  # no room to verify
    request.spec_acceptance = 0.0
    assert spec.lookahead(request, 1, running=1, tokens_left=10) == 0
    while request.num_output_tokens % PROBE_EVERY:
        request.append_output_token(5)
    request.num_computed_tokens = request.num_tokens - 1
    assert spec.lookahead(request, 1, running=1, tokens_left=10) == 1  # a probe


# ---- grammar --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_config(smollm2_path))


@pytest.fixture
def constrained(tokenizer):
    backend = make_backend("guidance", tokenizer, 49152, [2])

    def make(regex: str, **params) -> Request:
        request = make_request("g", [1, 2], **params)
        request.grammar = backend.compile(StructuredOutputsParams(regex=regex)).matcher()
        return request
    return make


def test_grammar_cuts_drafts_and_ends_a_request_at_a_refused_token(constrained, tokenizer):
    policy = GrammarPolicy()
    request = constrained(r"cat [0-9]+")
    cat = tokenizer.encode("cat", add_special_tokens=False)
    bad = tokenizer.encode("!", add_special_tokens=False)
    assert policy.needs_token_first(request)
    assert policy.cut(request, cat + bad) == cat
    assert policy.accept(request, cat[0]) is None
    assert policy.accept(request, bad[0]) == RequestStatus.FINISHED_ERROR
    assert request.stop_reason.startswith("grammar dead end")
    plain = make_request("p", [1])
    assert not policy.needs_token_first(plain)
    assert policy.cut(plain, bad) == bad and policy.accept(plain, bad[0]) is None


def test_jump_forward_appends_the_forced_tokens_unless_logprobs_are_asked(constrained,
                                                                          tokenizer):
    forced = tokenizer.encode('{"name": "', add_special_tokens=False)
    appended: list[int] = []

    def append(request: Request, token: int) -> RequestStatus | None:
        appended.append(token)
        request.grammar.accept(token)
        return None

    policy = GrammarPolicy()
    assert policy.jump(constrained(r'\{"name": "[a-z]+"\}'), 64, append) is None
    assert tokenizer.decode(appended).startswith('{"name": "')
    assert policy.num_jump_forward_tokens == len(appended) >= len(forced) // 2
    appended.clear()
    assert policy.jump(constrained(r'\{"name": "[a-z]+"\}'), 1, append) is None
    assert len(appended) == 1  # at most the tokens left
    appended.clear()
    for quiet in (GrammarPolicy(jump_forward=False), GrammarPolicy()):
        request = constrained(r'\{"name": "[a-z]+"\}', logprobs=None if not quiet.jump_forward
                              else 1)
        assert quiet.jump(request, 64, append) is None
    assert appended == []
