#!/usr/bin/env bash
# The smallest recipe that really runs: the CPU demo's tiny Qwen2-style model (assets from
# examples/cpu_demo/prepare.py), 3 GRPO steps on 2 gloo processes (PP=2) with the embedded
# rollout server. A dry run first, as on a cluster. No GPU needed; a few minutes on 2 cores.
#   bash examples/run_grpo_cpu_tiny.sh [--set key=value ...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ASSETS=runs/cpu_demo/assets
OUTPUT_DIR=runs/cpu_tiny
if [ ! -f "$ASSETS/model/config.json" ]; then
  python examples/cpu_demo/prepare.py --out "$ASSETS" --warmup-steps 100
fi
rm -rf "$OUTPUT_DIR"  # a fresh run each time (an existing checkpoint would be resumed)
TINY_ARGS=(
  --config examples/cpu_demo/grpo.yaml
  --set output_dir="$OUTPUT_DIR"
  --set train.total_steps=3
  --set train.save_interval=0
  --set rollout.prompts_per_step=8
  --set metrics.tensorboard=false
)
megatron-grpo train --dry-run --world-size 2 "${TINY_ARGS[@]}" "$@"
torchrun --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29500}" \
  -m megatron_grpo.cli train "${TINY_ARGS[@]}" "$@"
echo "metrics: $OUTPUT_DIR/metrics.jsonl"
