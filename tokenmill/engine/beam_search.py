"""Beam search over the engine, with Hugging Face's rules (`generate(num_beams=W)`).

Each step asks the engine for the top 2W next-token logprobs of every live beam (one request per
beam with max_tokens=1, as vLLM's `LLM.beam_search` does) and then applies HF's selection:

- the 2W best (beam score + logprob) continuations over all beams are candidates;
- a candidate ending in EOS, or reaching max_tokens, is finished; the finished ones among the
  first W candidates enter a pool of the W best finished hypotheses, scored
  sum_logprob / generated_len ** length_penalty;
- the W best unfinished candidates are the next beams;
- search stops when every candidate finished, or (HF's early_stopping=False heuristic) when the
  pool is full and the best running beam, length-normalised now, cannot beat its worst entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as in vLLM
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


@dataclass
class _Search:
    prompt: list[int]
    beams: list[tuple[list[int], float]]  # (generated tokens, cumulative logprob)
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False


GenerateFn = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


def beam_search(generate: GenerateFn, prompts: Sequence[list[int]], params: BeamSearchParams,
                eos_token_ids: Sequence[int]) -> list[BeamSearchOutput]:
    """`generate(token_prompts, sampling_params)` runs the engine; returns one output per prompt."""
    width = params.beam_width
    step_params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width,
                                 ignore_eos=True)
    eos = set() if params.ignore_eos else set(eos_token_ids)
    searches = [_Search(list(p), [([], 0.0)]) for p in prompts]
    for step in range(params.max_tokens):
        live = [s for s in searches if not s.done]
        if not live:
            break
        requests = [s.prompt + beam for s in live for beam, _ in s.beams]
        outs = iter(generate(requests, step_params))
        last = step + 1 == params.max_tokens
        for s in live:
            top = [next(outs).outputs[0].logprobs[0] for _ in s.beams]
            _advance(s, top, width, eos, last, step + 1, params.length_penalty)
    return [_result(s, width) for s in searches]


def _advance(s: _Search, top: list[dict], width: int, eos: set[int], last: bool,
             gen_len: int, length_penalty: float) -> None:
    candidates = sorted(((score + lp.logprob, b, tid)
                         for b, (beam, score) in enumerate(s.beams)
                         for tid, lp in top[b].items()), key=lambda c: -c[0])[:2 * width]
    hits = [last or tid in eos for _, _, tid in candidates]
    if s.improvable:
        for (score, b, tid), hit in zip(candidates[:width], hits[:width], strict=True):
            if hit:
                s.finished.append((score / gen_len ** length_penalty,
                                   s.beams[b][0] + [tid], score))
        s.finished = sorted(s.finished, key=lambda f: -f[0])[:width]
    s.beams = [(s.beams[b][0] + [tid], score)
               for (score, b, tid), hit in zip(candidates, hits, strict=True) if not hit][:width]
    if s.beams:
        best_running = s.beams[0][1] / gen_len ** length_penalty
        worst_finished = s.finished[-1][0] if len(s.finished) == width else -1e9
        s.improvable = s.improvable and best_running > worst_finished
    s.done = all(hits) or not s.improvable or not s.beams


def _result(s: _Search, width: int) -> BeamSearchOutput:
    return BeamSearchOutput([BeamSearchSequence(tokens=s.prompt + toks, cum_logprob=cum,
                                                score=score)
                             for score, toks, cum in s.finished[:width]])
