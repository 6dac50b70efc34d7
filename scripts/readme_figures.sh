#!/usr/bin/env bash
# The README's figures, taken afresh: runs each CPU example as a fresh clone would (new
# assets, new output directories, at each config's seed) and prints the lines the README
# shows, also kept in docs/readme_figures.txt (tests/unit/test_readme.py checks that the
# README holds each of them). Lines starting with '#' are times, for the prose around them.
#
#   bash scripts/readme_figures.sh          # about 10 minutes on 2 CPU cores
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
OUT=docs/readme_figures.txt
LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT
rm -rf runs/cpu_demo runs/tool_demo

timed() {  # timed NAME COMMAND...: the command's output in $LOG/NAME, its seconds printed
  local name=$1 start
  shift
  start=$(date +%s)
  "$@" >"$LOG/$name" 2>&1 || { tail -20 "$LOG/$name" >&2; exit 1; }
  echo "# $name: $(($(date +%s) - start)) s"
}

steps_time() {  # the seconds a run's steps took (rollout, train and weight sync)
  python - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
keys = ("perf/time_rollout_s", "perf/time_train_s", "perf/time_sync_s")
print(f"{sum(r.get(k, 0.0) for r in rows for k in keys):.0f}")
PY
}

{
  timed "cpu demo (assets included)" bash examples/cpu_demo/run.sh
  echo "# cpu demo: $(steps_time runs/cpu_demo/grpo) s of steps"
  grep -E "^step +1/40 " "$LOG/cpu demo (assets included)" | cut -d'|' -f1-3 | sed 's/ *$/ | .../'
  grep -E "^step +40/40 " "$LOG/cpu demo (assets included)" | cut -d'|' -f1-2 | sed 's/ *$/ | .../'
  grep "^reward:" "$LOG/cpu demo (assets included)"
  timed "moe demo (assets included)" bash examples/cpu_demo/run.sh \
    --set train.init=runs/cpu_demo/assets/moe_model
  grep "^reward:" "$LOG/moe demo (assets included)"
  timed "tool demo (assets included)" bash examples/tool_demo/run.sh
  echo "# tool demo: $(steps_time runs/tool_demo/grpo) s of steps"
  grep -E "^(reward:|held-out)" "$LOG/tool demo (assets included)"
} | tee "$OUT"
