#!/usr/bin/env bash
# The main job on the CPU default: set up (or reuse) .venv, then prove on real multi-process
# gloo runs that the GRPO gradient of one global batch is the same at every parallel layout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
. "${VENV:-.venv}/bin/activate"
megatron-grpo check-invariance --mode all "$@"
