"""Weight-format specs of the benchmarks: engine options, int4's load-time settings applied
inside the block and restored after it, bad suffixes refused."""

from __future__ import annotations

import pytest

from tokenmill import quantization
from tokenmill.bench.weight_specs import weights_as
from tokenmill.quantization import load_time


def test_specs_become_engine_options_and_settings_are_restored():
    with weights_as("none") as w:
        assert w == {"quantization": "none", "int8_activations": False}
    with weights_as("gguf+int8acts") as w:
        assert w == {"quantization": "gguf", "int8_activations": True}
    with weights_as("int4/64+rtn") as w:
        assert w["quantization"] == "int4"
        assert load_time.INT4_GROUP == 64 and quantization.INT4_CALIBRATION is False
    assert load_time.INT4_GROUP == 32 and quantization.INT4_CALIBRATION is True


@pytest.mark.parametrize("spec", ["gguf+fast", "int8/64", "gguf+rtn"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError), weights_as(spec):
        pass
