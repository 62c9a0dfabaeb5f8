"""worker/in_flight.py: a step's sampled ids left on the device, fed to the next step's inputs
there, and brought to the host once (on a CUDA machine through pinned memory and an event:
benchmarks/gpu_session.sh runs this file there). End to end, the async-scheduling engine tests
(tests/engine/test_async_scheduling.py, test_failure_isolation.py) run every step this way."""

from __future__ import annotations

import torch

from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import ModelRunnerOutput, ScheduledRequest
from tokenmill.layers.sampler import LogprobTensors
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.in_flight import PLACEHOLDER, InFlightStep
from tokenmill.worker.step_sampling import SampledLogprobs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def request(req_id: str, tokens: list[int], start: int) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=tokens, start_pos=start, block_ids=[1, 2],
                            sample=True, sampling_params=SamplingParams(),
                            prompt_token_ids=[], output_token_ids=[])


def test_tokens_in_flight_are_fed_on_the_device_then_written_once():
    out = ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[], [], []])
    lists = [[11, 12], [21]]  # the runner's output lists of the rows that sampled (a, c)
    tokens = torch.tensor([105, 307], device=DEVICE)
    step = InFlightStep.start(out, [0, 2], tokens, None, lists)
    assert lists == [[11, 12, PLACEHOLDER], [21, PLACEHOLDER]]
    assert not step.done.done() and out.sampled_token_ids == [[], [], []]

    # the next step: "c" feeds its in-flight token (decode), "b" a prefill chunk, "a" too
    reqs = [request("c", [PLACEHOLDER], 5), request("b", [7, 8, 9], 0),
            request("a", [PLACEHOLDER], 3)]
    batch = InputBatch.build(reqs, 16, DEVICE)
    assert step.feed(batch, reqs) == 2
    assert batch.input_ids.tolist() == [307, 7, 8, 9, 105]

    step.finish()
    step.finish()  # idempotent
    assert lists == [[11, 12, 105], [21, 307]]
    assert step.done.result() is out
    assert out.sampled_token_ids == [[105], [], [307]]


def test_a_step_feeding_nothing_in_flight_is_left_as_built():
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]])
    step = InFlightStep.start(out, [0], torch.tensor([9], device=DEVICE), None, [[1]])
    reqs = [request("b", [4, 5], 0)]
    batch = InputBatch.build(reqs, 16, DEVICE)
    assert step.feed(batch, reqs) == 0
    assert batch.input_ids.tolist() == [4, 5]


def test_logprobs_in_flight_come_with_their_tokens_each_cut_to_its_request():
    """A step left in flight with logprobs asked: their copies go with the ids (no wait of
    their own), and `finish` writes each request's rows, cut to its own top-k."""
    out = ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[], [], []])
    tensors = LogprobTensors(  # rows of the sampling rows (a, c): chosen, then the top 2
        token_ids=torch.tensor([[105, 105, 3], [307, 4, 307]], device=DEVICE),
        logprobs=torch.tensor([[-0.5, -0.5, -1.5], [-2.0, -0.25, -2.0]], device=DEVICE),
        ranks=torch.tensor([[1, 1, 2], [2, 1, 2]], device=DEVICE))
    logprobs = SampledLogprobs(tensors.to_host(), [("a", 0, 3), ("c", 1, 1)])
    step = InFlightStep.start(out, [0, 2], torch.tensor([105, 307], device=DEVICE), logprobs,
                              [[11], [21]])
    assert out.logprobs == {}
    step.finish()
    assert out.sampled_token_ids == [[105], [], [307]]
    assert out.logprobs["a"].token_ids == [[105, 105, 3]]
    assert out.logprobs["a"].logprobs == [[-0.5, -0.5, -1.5]]
    assert out.logprobs["a"].ranks == [[1, 1, 2]]
    assert (out.logprobs["c"].token_ids, out.logprobs["c"].ranks) == ([[307]], [[2]])
    assert "b" not in out.logprobs
