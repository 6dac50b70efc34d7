#!/usr/bin/env bash
# The GPU benchmark in one command, within 600 s on one H100/H200 once its set-up is cached:
#   train-step MFU of a ~1B Qwen3-shaped model (bf16, Transformer Engine when importable;
#   reference: megatron-core's cross-entropy step on the same batch), SGLang generation
#   tokens/s (reference: one direct batched /generate), and learner -> SGLang weight-push GB/s
#   (reference: one request holding every tensor); JSON to OUT, figures into docs/benchmarks.md.
#
#   bash bench/gpu.sh [OUT]          # default OUT: bench/results/gpu.json
#
# Budget, in seconds: set-up 90 when cached (scripts/setup_gpu_env.sh, the GPU tier's
# environments; a cold machine's first call installs them, up to 1800), then gpu_bench.py
# under `timeout 470` (its parts: mfu 200, sglang 250), then the report.
# Without a GPU it prints that none is present, writes a JSON saying so and exits 0,
# installing nothing. PYTHON (and SGLANG_PYTHON): use these interpreters, no set-up;
# SGLANG_ARGS: extra server arguments.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-bench/results/gpu.json}
SETUP_WARM_S=90
SETUP_COLD_S=1800
BENCH_S=470
if [ -z "${PYTHON:-}" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    limit=$SETUP_WARM_S
    plan=$(bash scripts/setup_gpu_env.sh --dry-run)
    if [[ $plan == *"would install"* ]]; then
      limit=$SETUP_COLD_S
      echo "gpu.sh: the set-up is not cached: installing it first (up to ${SETUP_COLD_S} s)"
    fi
    timeout -k 10 "$limit" bash scripts/setup_gpu_env.sh
    PYTHON=${GPU_VENV:-.venv-gpu}/bin/python
    export SGLANG_PYTHON=${SGLANG_PYTHON:-${SGLANG_GPU_VENV:-.venv-sglang-gpu}/bin/python}
  elif [ -x .venv/bin/python ]; then
    PYTHON=.venv/bin/python  # no GPU: gpu_bench.py says so
  else
    PYTHON=python
  fi
fi
# Each part has its own limit inside gpu_bench.py; this one bounds the whole run.
timeout --kill-after=15 "$BENCH_S" "$PYTHON" bench/gpu_bench.py --out "$OUT"
"$PYTHON" bench/gpu_report.py --bench "$OUT"
