#!/usr/bin/env bash
# The CPU demo: make the assets (data, tokenizer, tiny warmed-up model), run GRPO on two
# gloo processes (PP=2) with the embedded rollout server, and plot reward and length.
# Usage: bash examples/cpu_demo/run.sh [--set key=value ...]   (run from the repository root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ASSETS=runs/cpu_demo/assets
if [ ! -f "$ASSETS/model/config.json" ] || [ ! -f "$ASSETS/eval.jsonl" ]; then
  python examples/cpu_demo/prepare.py --out "$ASSETS" --warmup-steps 100
fi
megatron-grpo train --config examples/cpu_demo/grpo.yaml --nproc 2 "$@"
megatron-grpo plot runs/cpu_demo/grpo
python - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/cpu_demo/grpo/metrics.jsonl")]
first, last = rows[:5], rows[-5:]
mean = lambda rs: sum(r["rollout/reward_mean"] for r in rs) / len(rs)
print(f"reward: first 5 steps {mean(first):.3f} -> last 5 steps {mean(last):.3f} "
      f"({len(rows)} steps); plots in runs/cpu_demo/grpo")
PY
