#!/usr/bin/env bash
# The CPU tool-use demo: make the assets (data, tokenizer, tiny warmed-up model), run GRPO
# with the built-in tool loop on two gloo processes (PP=2) and the embedded rollout
# server, and plot reward and length.
# Usage: bash examples/tool_demo/run.sh [--set key=value ...]   (from the repository root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ASSETS=runs/tool_demo/assets
OUT=runs/tool_demo/grpo
if [ ! -f "$ASSETS/model/config.json" ] || [ ! -f "$ASSETS/eval.jsonl" ]; then
  python examples/tool_demo/prepare.py --out "$ASSETS"
fi
megatron-grpo train --config examples/tool_demo/grpo.yaml --nproc 2 --set "output_dir=$OUT" "$@"
megatron-grpo plot "$OUT"
python - "$OUT" <<'PY'
import json
import sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if '"rollout/reward_mean"' in l]
first, last = rows[:5], rows[-5:]
mean = lambda rs, k: sum(r[f"rollout/{k}"] for r in rs) / len(rs)
print(f"reward: first 5 steps {mean(first, 'reward_mean'):.3f} -> last 5 steps "
      f"{mean(last, 'reward_mean'):.3f}; tool calls per episode "
      f"{mean(first, 'tool_calls_mean'):.2f} -> {mean(last, 'tool_calls_mean'):.2f} "
      f"({len(rows)} steps); plots in {out}")
evals = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if '"eval/arith/pass@1"' in l]
if evals:
    print("held-out pass@1 " + " -> ".join(
        f"{r['eval/arith/pass@1']:.3f} (step {r['step']})" for r in evals))
PY
