#!/usr/bin/env bash
# The loss-normalization comparison on the length-bias task: make the assets (data, tokenizer,
# tiny warmed-up model), train the same config once per loss mode and seed (one run at a time,
# 2 gloo processes each), and write one figure per metric and the summary table.
# Usage: bash examples/length_bias/run.sh [--seeds N] [--modes a,b] [--set key=value ...]
# (from the repository root; runs already finished under runs/length_bias are reused)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ASSETS=runs/length_bias/assets
if [ ! -f "$ASSETS/model/config.json" ]; then
  python examples/length_bias/prepare.py --out "$ASSETS"
fi
megatron-grpo compare-modes --config examples/length_bias/grpo.yaml --modes all --seeds 2 \
  --nproc 2 --threshold 0.6 "$@"
