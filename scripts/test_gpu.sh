#!/usr/bin/env bash
# The GPU tier in one command, on a machine with an NVIDIA GPU (sized for one H200):
# set up or reuse its environments (scripts/setup_gpu_env.sh), run tests/gpu part by part,
# each under its own time limit, and write what it measured into docs/benchmarks.md
# (bench/gpu_report.py, with the date and the device).
#
#   bash scripts/test_gpu.sh                # set-up, then every part
#   bash scripts/test_gpu.sh --dry-run      # what it would install and run, the budgets; no change
#   bash scripts/test_gpu.sh --setup-only   # the set-up alone (a cold machine's first call)
#
# Budget, in seconds, enforced with `timeout` (a part over its limit is stopped and counted
# failed; the next part still runs). With the set-up cached the whole run fits in 600 s.
# A cold set-up does not: it downloads about 7 GB and builds Transformer Engine's extension,
# under its own limit (SETUP_COLD_S), once; later calls reuse it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SETUP_WARM_S=90       # stamps checked, imports verified
SETUP_COLD_S=1800     # first call on a bare machine: downloads and a source build (estimate)
PARTS=(
  # name              budget_s  tests
  "layer_specs        65        tests/gpu/test_gpu_layer_specs.py"
  "invariance         140       tests/gpu/test_gpu_invariance.py"
  "context_parallel   40        tests/gpu/test_gpu_context_parallel.py"
  "sglang             170       tests/gpu/test_gpu_sglang.py"
  "demo               95        tests/gpu/test_gpu_demo.py tests/gpu/test_gpu_offload.py"
)
TOTAL_S=600           # set-up (warm) + the parts + the report stay under this
RESULTS=${MGRPO_GPU_RESULTS:-runs/gpu_tier/results.json}
VENV=${GPU_VENV:-.venv-gpu}
SGL_VENV=${SGLANG_GPU_VENV:-.venv-sglang-gpu}

mode=run
case "${1:-}" in
  --dry-run) mode=dry; shift ;;
  --setup-only) mode=setup; shift ;;
esac

warm() { # every set-up step stamped: the environments exist and are current
  local plan
  plan=$(bash scripts/setup_gpu_env.sh --dry-run)
  [[ $plan != *"would install"* ]]
}

if [ "$mode" = dry ]; then
  echo "test_gpu: dry run: nothing is installed or run"
  echo "test_gpu: set-up (scripts/setup_gpu_env.sh), budget ${SETUP_WARM_S} s when cached," \
    "${SETUP_COLD_S} s on a cold machine:"
  bash scripts/setup_gpu_env.sh --dry-run | sed 's/^/  /'
  sum=$SETUP_WARM_S
  for part in "${PARTS[@]}"; do
    read -r name budget tests <<<"$part"
    sum=$((sum + budget))
    echo "test_gpu: part $name, budget ${budget} s: timeout -k 10 $budget $VENV/bin/python" \
      "-m pytest -m gpu $tests"
  done
  echo "test_gpu: report: $VENV/bin/python bench/gpu_report.py --tests $RESULTS (docs/benchmarks.md)"
  echo "test_gpu: total budget ${sum} s of ${TOTAL_S} s with the set-up cached"
  exit 0
fi

start=$(date +%s)
if warm; then
  setup_limit=$SETUP_WARM_S
else
  setup_limit=$SETUP_COLD_S
  echo "test_gpu: the set-up is not cached: this call installs it (up to ${SETUP_COLD_S} s)" \
    "and so takes longer than ${TOTAL_S} s; later calls reuse it"
fi
timeout -k 10 "$setup_limit" bash scripts/setup_gpu_env.sh ||
  { echo "test_gpu: set-up failed or ran past ${setup_limit} s" >&2; exit 1; }
[ "$mode" = setup ] && exit 0

PY="$VENV/bin/python"
mkdir -p "$(dirname "$RESULTS")"
rm -f "$RESULTS"
export MGRPO_GPU_TIER=1 MGRPO_GPU_RESULTS="$RESULTS" SGLANG_PYTHON="$SGL_VENV/bin/python"
"$PY" - "$RESULTS" "$SGLANG_PYTHON" <<'PY'
import json, subprocess, sys, time
import torch, transformer_engine
sglang = subprocess.run([sys.argv[2], "-c", "import sglang; print(sglang.__version__)"],
                        capture_output=True, text=True).stdout.strip()
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
env = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
       "torch": torch.__version__, "transformer_engine": transformer_engine.__version__,
       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "sglang": sglang or None,
       "commit": commit or None}
json.dump({"date": time.strftime("%Y-%m-%d"), "environment": env, "parts": {}},
          open(sys.argv[1], "w"), indent=2)
PY

failed=0
for part in "${PARTS[@]}"; do
  read -r name budget tests <<<"$part"
  echo "test_gpu: part $name (limit ${budget} s)"
  t0=$(date +%s)
  set +e
  timeout -k 10 "$budget" "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider "$tests" "$@"
  code=$?
  set -e
  seconds=$(($(date +%s) - t0))
  case $code in
    0) status=passed ;;
    124 | 137) status="timed out (over ${budget} s)"; failed=1 ;;
    *) status="failed (exit $code)"; failed=1 ;;
  esac
  "$PY" - "$RESULTS" "$name" "$status" "$seconds" "$budget" <<'PY'
import json, sys
path, name, status, seconds, budget = sys.argv[1:]
data = json.load(open(path))
data["parts"][name] = {"status": status, "seconds": int(seconds), "budget_s": int(budget)}
json.dump(data, open(path, "w"), indent=2)
PY
  echo "test_gpu: part $name: $status in ${seconds} s"
done
"$PY" bench/gpu_report.py --tests "$RESULTS"
echo "test_gpu: done in $(($(date +%s) - start)) s; results in $RESULTS and docs/benchmarks.md"
exit $failed
