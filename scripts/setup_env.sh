#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything into it.
# Usage: source scripts/setup_env.sh   (or bash it; it leaves .venv ready either way)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
# torch first: on a machine without CUDA this takes the CPU wheel; any other torch
# request would pull a multi-GB CUDA build. On GPU machines set TORCH_SPEC as needed.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install --quiet -e ".[test]"
# SGLang's own msgspec contract (api_types.py) validates our client and embedded server.
# Only that file is kept, under $VENV/share: sglang itself lives in .venv-sglang.
python -m megatron_grpo.testing.sglang_contract >/dev/null
