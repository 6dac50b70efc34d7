#!/usr/bin/env bash
# The main job on the CPU default: set up (or reuse) .venv, then run GRPO on verifiable
# addition with a tiny locally made model, 2 gloo processes (PP=2) and the embedded
# rollout server; prints the reward of the first and last steps and writes the plots.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
. "${VENV:-.venv}/bin/activate"
bash examples/cpu_demo/run.sh "$@"
