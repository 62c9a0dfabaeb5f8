"""Structured outputs: what a grammar costs a batch, and what jump-forward saves, in one run.

    python benchmarks/structured.py [--rounds 3] [--batch 16] [--quantization Q]

1. A batch of 16 JSON-schema chat requests (SmolLM2, greedy) against the same batch without a
   constraint, each unconstrained request made to emit exactly as many tokens as its
   constrained twin did (max_tokens = that count, ignore_eos), so that both batches do the same
   prefill and decode work. Decode tokens/s = output tokens / (batch time - time of the same
   batch cut to one token each); rounds alternate the engines (the machine drifts) and the
   median is kept. Constrained runs twice: with jump-forward (the default) and without it
   (every token a model step: the mask's own cost).
2. Jump-forward on a schema with long fixed keys: one request, with and without, same output;
   the tokens the grammar forced, model steps, and the time saved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "category": {"enum": ["person", "place", "thing", "idea"]},
                         "year": {"type": "integer", "minimum": 0, "maximum": 2100},
                         "facts": {"type": "array", "items": {"type": "string", "maxLength": 60},
                                   "minItems": 1, "maxItems": 3}},
          "required": ["name", "category", "year", "facts"]}
TOPICS = ["the Eiffel Tower", "Marie Curie", "the bicycle", "democracy", "Mount Everest",
          "Ada Lovelace", "the telephone", "the Amazon river", "jazz music", "Isaac Newton",
          "the printing press", "Tokyo", "photosynthesis", "the Great Wall of China",
          "Leonardo da Vinci", "the internet"]
LONG_KEYS = {"type": "object",
             "properties": {k: {"type": "string", "maxLength": 24} for k in (
                 "customer_full_legal_name", "customer_primary_shipping_address_line_one",
                 "customer_primary_shipping_address_city_name",
                 "customer_preferred_contact_email_address",
                 "order_special_delivery_instructions_for_courier")},
             "required": ["customer_full_legal_name", "customer_primary_shipping_address_line_one",
                          "customer_primary_shipping_address_city_name",
                          "customer_preferred_contact_email_address",
                          "order_special_delivery_instructions_for_courier"]}


def chat_prompt(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
        ) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def one_token(params: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                          structured_outputs=params.structured_outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    engines = {"constrained": LLM(quantization=args.quantization),
               "no jump-fwd": LLM(quantization=args.quantization,
                                  structured_outputs_config={"jump_forward": False})}
    engines["unconstrained"] = engines["constrained"]  # the same engine, no constraint
    llm = engines["constrained"]
    print(describe_machine())
    print(f"SmolLM2-135M-Instruct, weights {llm.engine.config.model.quantization or 'float32'}, "
          f"backend {llm.engine.structured.backend.name}, batch {args.batch}, greedy, "
          f"{args.rounds} rounds")

    topics = (TOPICS * (args.batch // len(TOPICS) + 1))[:args.batch]
    prompts = [chat_prompt(llm, f"Give the name, category, year and up to three facts about "
                                f"{t} as JSON.") for t in topics]
    constrained = [SamplingParams(temperature=0, max_tokens=200,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA))
                   for _ in prompts]
    _, reference = run(llm, prompts, constrained)  # also warms both engines up
    run(engines["no jump-fwd"], prompts, constrained)
    valid = sum(_valid(llm, ids) for ids in reference)
    lengths = [len(ids) for ids in reference]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    params = {"unconstrained": free, "constrained": constrained, "no jump-fwd": constrained}
    secs: dict[str, list[float]] = {k: [] for k in params}
    for _ in range(args.rounds):
        for label, ps in params.items():
            full, ids = run(engines[label], prompts, ps)
            first, _ = run(engines[label], prompts, [one_token(p) for p in ps])
            assert [len(i) for i in ids] == lengths, label
            secs[label].append(full - first)
    tokens = sum(n - 1 for n in lengths)
    print(f"\n{args.batch} JSON-schema requests, {sum(lengths)} output tokens, "
          f"{valid}/{args.batch} parse and follow the schema")
    print(f"{'batch':<16}{'decode tok/s':>13}{'vs unconstrained':>18}")
    base = tokens / statistics.median(secs["unconstrained"])
    for label in params:
        rate = tokens / statistics.median(secs[label])
        print(f"{label:<16}{rate:>13.1f}{rate / base:>17.2f}x")

    prompt = chat_prompt(llm, "Fill in a delivery order for a customer in Lisbon as JSON.")
    p = SamplingParams(temperature=0, max_tokens=300,
                       structured_outputs=StructuredOutputsParams(json=LONG_KEYS))
    times: dict[str, list[float]] = {"constrained": [], "no jump-fwd": []}
    outs, forced = {}, 0
    for _ in range(args.rounds):
        for label in times:
            before = engines[label].engine.scheduler.num_jump_forward_tokens
            t, (ids,) = run(engines[label], [prompt], [p])
            forced = engines[label].engine.scheduler.num_jump_forward_tokens - before or forced
            times[label].append(t)
            outs[label] = ids
    on, off = (statistics.median(times[k]) for k in ("constrained", "no jump-fwd"))
    n = len(outs["constrained"])
    print(f"\njump-forward, long fixed keys: {n} output tokens, {forced} forced by the grammar "
          f"({n - forced} model steps instead of {n}); same output: "
          f"{'yes' if outs['constrained'] == outs['no jump-fwd'] else 'NO'}")
    print(f"  with {on:.3f} s, without {off:.3f} s: {off - on:.3f} s saved "
          f"({off / on:.2f}x)")


def _valid(llm: LLM, ids: list[int]) -> bool:
    try:
        value = json.loads(llm.get_tokenizer().decode(ids, skip_special_tokens=True))
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


if __name__ == "__main__":
    main()
