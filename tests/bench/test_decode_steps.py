"""benchmarks/decode_steps.py's rounds: a batch of sequences stepped together (--batch, the
batched decode step a kernel change is measured by), every request finished and every KV
block freed after the round; a batch with llama.cpp's one-sequence turn is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import assert_kv_all_free
from tokenmill import LLM
from tokenmill.bench.decode_steps import run_round

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_steps.py"


def test_a_round_steps_every_prompt_of_the_batch_together(tiny_model):
    folder, _ = tiny_model("llama")
    llm = LLM(folder, max_model_len=128)
    engine = llm.engine
    stepped: list[int] = []
    step = engine.step

    def counting_step():
        outputs = step()
        stepped.append(len(outputs))
        return outputs

    engine.step = counting_step
    prompts = [[5 + i, 9, 17, 3 + i] for i in range(3)]
    times = run_round(llm, None, None, prompts, steps=4, block=2, rng=np.random.default_rng(0))
    assert list(times) == ["tokenmill"] and times["tokenmill"] > 0
    assert max(stepped) == 3  # the three sequences decoded in the same steps
    assert not engine.has_unfinished_requests()
    assert_kv_all_free(engine)


def test_a_batch_needs_no_peer():
    proc = subprocess.run([sys.executable, str(SCRIPT), "missing.gguf", "--batch", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--batch > 1 needs --no-peer" in proc.stderr
