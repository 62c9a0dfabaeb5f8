"""executor/base.driver_output: which replies to a step are one step's failure (the engine
re-executes its requests one by one) and which are fatal (a rank out of step with its
stage); ranks are stage-major, the driver is the last stage's first rank."""

from __future__ import annotations

import pytest

from tokenmill.core.interface import ModelRunnerOutput
from tokenmill.executor.base import WorkerDiedError, driver_output
from tokenmill.worker.model_runner import KVBlockOpsError

OUT = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]])
OK, NONE = ("ok", OUT), ("ok", None)
UP = ("peer_failed", "an earlier pipeline stage failed this step")


def err(why: str = "IndexError: index out of range") -> tuple[str, str]:
    return ("error", why)


@pytest.mark.parametrize(("replies", "tp"), [
    ([OK], 1),
    ([OK, NONE], 2),              # TP=2: rank 0 drives
    ([NONE, OK], 1),              # PP=2: the last stage drives
    ([NONE, NONE, OK, NONE], 2),  # TP=2 x PP=2: rank 2 drives
])
def test_the_driver_s_output(replies, tp):
    assert driver_output(replies, tp) is OUT


@pytest.mark.parametrize(("replies", "tp"), [
    ([err()], 1),
    ([err(), err()], 2),                   # a TP stage alike
    ([err(), NONE], 2),                    # TP: the driver alone (sampling)
    ([NONE, err()], 1),                    # PP: the driver alone (sampling)
    ([err(), UP], 1),                      # PP: the first stage, the next one told
    ([err(), err(), UP, UP], 2),           # TP x PP: the first stage whole
    ([NONE, NONE, err(), NONE], 2),        # TP x PP: the driver alone
    ([NONE, NONE, err(), err()], 2),       # TP x PP: the last stage whole
])
def test_one_step_s_failure_is_raised_for_the_engine_to_isolate(replies, tp):
    with pytest.raises(RuntimeError, match="index out of range") as e:
        driver_output(replies, tp)
    assert not isinstance(e.value, WorkerDiedError)


@pytest.mark.parametrize(("replies", "tp"), [
    ([OK, err()], 2),                      # TP: a rank apart from the driver
    ([err(), NONE, UP, UP], 2),            # TP x PP: one rank of the first stage
    ([NONE, NONE, OK, err()], 2),          # TP x PP: a non-driver rank of the last stage
    ([err("a"), err("b")], 2),             # TP: the same stage, different reasons
    ([NONE, UP], 1),                       # told of a failure nobody reported
])
def test_a_rank_out_of_step_is_fatal(replies, tp):
    with pytest.raises(WorkerDiedError):
        driver_output(replies, tp)


def test_failed_block_operations_are_their_own_error():
    with pytest.raises(KVBlockOpsError, match="swap"):
        driver_output([("kv_error", "swap failed"), UP], 1)
