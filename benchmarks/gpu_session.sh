#!/usr/bin/env bash
# The GPU checks in one command, for the lent CUDA machine (no package registry there: it runs
# that machine's own torch, triton and transformers, with tokenmill from this folder):
#
#   bash benchmarks/gpu_session.sh --save-tokenizer DIR     (here, where the model package is)
#   bash benchmarks/gpu_session.sh OUT_DIR TOKENIZER_DIR [PART ...]      (there)
#
# TOKENIZER_DIR: SmolLM2's tokenizer saved by --save-tokenizer (its GGUF file is too large to
# travel). PARTs (default all): tests (attention backends, CUDA graphs, HF parity, the
# fused-MoE kernel and multi-LoRA, on the GPU), shapes (benchmarks/real_shapes.py), profile
# (benchmarks/profile_step.py: batch-64 decode steps of the 1B shape with CUDA graphs and
# eager, host scopes and device kernels), offline (benchmarks/offline_throughput.py on the 8B
# shape: 1,000 ShareGPT-like requests, then 64 of them beside Hugging Face static batching),
# moe (benchmarks/moe.py on the GPU; not in the default, which fits 10 minutes: on an H200 the
# tests took ~2 minutes, shapes ~2). Each part has its own time limit and log under OUT_DIR,
# so one that fails or hangs leaves the others their time.
set -u
if [ "${1:-}" = --save-tokenizer ]; then
  exec python3 -c "import sys
from tokenmill.engine.tokenizer import gguf_tokenizer
from tokenmill.model_loader.default_model import default_model_path
gguf_tokenizer(default_model_path()).save_pretrained(sys.argv[1])" "${2:?DIR}"
fi
out=${1:?OUT_DIR}
tok=${2:?TOKENIZER_DIR}
shift 2
parts=${*:-tests shapes profile offline}
mkdir -p "$out"
# A pytest plugin that writes each failure's report the moment it happens, so that a run cut
# off by its time limit still says what failed and why.
plugin_dir=$(mktemp -d)
cat > "$plugin_dir/report_at_once.py" <<'PY'
import os

_controller = True


def pytest_configure(config):
    global _controller
    _controller = not hasattr(config, "workerinput")  # xdist: the controller writes


def pytest_runtest_logreport(report):
    if _controller and (report.failed or report.when == "call"):
        with open(os.environ["TESTS_REPORT"], "a") as f:
            f.write(f"{report.outcome.upper()} {report.nodeid} ({report.duration:.1f} s)\n")
            if report.failed:
                f.write(report.longreprtext[-4000:] + "\n\n")
PY
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$plugin_dir TOKENMILL_TEST_TOKENIZER_DIR=$tok
export TESTS_REPORT=$out/tests_report.log
# The C++ kernels are CPU kernels; their tests run in CI. Skipping their build saves minutes.
export TOKENMILL_CPU_KERNELS=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)"
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    # 8 test processes of 2 threads each on the machine's 16 cores
    # the memory-profile tests first and alone (they fill shares of the GPU), then the rest
    tests) timeout "${TESTS_S:-150}" sh -c "python3 -m pytest -q -p no:cacheprovider \
             -p report_at_once -rfE --timeout 120 tests/worker/test_memory_profile.py;
           OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider \
             -p report_at_once -rfE -n 8 --timeout 120 \
             tests/attention tests/worker tests/models/test_hf_parity.py \
             tests/layers/test_fused_moe_triton.py tests/layers/test_triton_ops.py \
             tests/quantization/test_triton_block_gemm.py tests/quantization/test_fp8.py \
             tests/quantization/test_fp8_checkpoints.py \
             tests/lora/test_lora_generate.py::test_mixed_adapters_match_peft_on_cuda \
             tests/utils/test_cuda_device.py tests/utils/test_host_syncs.py \
             --ignore=tests/worker/test_memory_profile.py" 2>&1 | tee "$out/tests.log" ;;
    shapes) timeout "${SHAPES_S:-150}" python3 benchmarks/real_shapes.py \
              --json "$out/real_shapes.json" 2>&1 | tee "$out/real_shapes.log" ;;
    profile) timeout "${PROFILE_S:-120}" sh -c "for eager in '' --enforce-eager; do
               python3 benchmarks/profile_step.py --model llama-1b --device cuda \
                 --dtype bfloat16 --scenario decode64 --steps 10 --ops 12 \$eager; done" 2>&1 \
               | tee "$out/profile.log" ;;
    offline) timeout "${OFFLINE_S:-170}" sh -c "python3 benchmarks/offline_throughput.py \
               --model llama-8b --dtype bfloat16 --json $out/offline.json &&
             python3 benchmarks/offline_throughput.py --model llama-8b --dtype bfloat16 \
               --num-requests 64 --hf-reference --json $out/offline_hf.json" 2>&1 \
               | tee "$out/offline.log" ;;
    moe) timeout "${MOE_S:-50}" python3 benchmarks/moe.py --device cuda --tokenizer "$tok" \
           --dtype "${MOE_DTYPE:-auto}" \
           --json "$out/moe.json" 2>&1 | tee "$out/moe.log" ;;
  esac
  echo "=== $part done $(date +%T) rc=${PIPESTATUS[0]}"
done
