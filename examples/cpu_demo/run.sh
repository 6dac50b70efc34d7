#!/usr/bin/env bash
# The CPU demo: make the assets (data, tokenizer, tiny warmed-up model), run GRPO on two
# gloo processes (PP=2) with the embedded rollout server, and plot reward and length.
# Usage: bash examples/cpu_demo/run.sh [--set key=value ...]   (run from the repository root)
# A tiny Qwen3-MoE instead: --set train.init=runs/cpu_demo/assets/moe_model (its own
# output directory, runs/cpu_demo/grpo_moe).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ASSETS=runs/cpu_demo/assets
OUT=runs/cpu_demo/grpo
PREPARE=()
case " $* " in
  *moe_model*) OUT=runs/cpu_demo/grpo_moe; PREPARE=(--moe) ;;
esac
if [ ! -f "$ASSETS/model/config.json" ] || [ ! -f "$ASSETS/eval.jsonl" ] \
  || { [ ${#PREPARE[@]} -gt 0 ] && [ ! -f "$ASSETS/moe_model/config.json" ]; }; then
  python examples/cpu_demo/prepare.py --out "$ASSETS" --warmup-steps 100 "${PREPARE[@]}"
fi
megatron-grpo train --config examples/cpu_demo/grpo.yaml --nproc 2 --set "output_dir=$OUT" "$@"
megatron-grpo plot "$OUT"
python - "$OUT" <<'PY'
import json
import sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
first, last = rows[:5], rows[-5:]
mean = lambda rs: sum(r["rollout/reward_mean"] for r in rs) / len(rs)
print(f"reward: first 5 steps {mean(first):.3f} -> last 5 steps {mean(last):.3f} "
      f"({len(rows)} steps); plots in {out}")
PY
