#!/usr/bin/env bash
# The GPU benchmark in one command, under 8 minutes, on one H100/H200:
#   train-step MFU of a ~1B Qwen3-shaped model (bf16, Transformer Engine when importable),
#   SGLang generation tokens/s, and learner -> SGLang weight-sync GB/s; JSON to OUT.
#
#   bash bench/gpu.sh [OUT]          # default OUT: bench/results/gpu.json
#
# Without a GPU it prints that none is present, writes a JSON saying so and exits 0.
# PYTHON: the interpreter with this package (default .venv/bin/python when present);
# SGLANG_PYTHON: the one with sglang (default PYTHON); SGLANG_ARGS: extra server arguments.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
OUT=${1:-bench/results/gpu.json}
# Each part has its own limit inside gpu_bench.py; this one bounds the whole run.
exec timeout --kill-after=15 470 "$PYTHON" bench/gpu_bench.py --out "$OUT"
