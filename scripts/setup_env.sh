#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything into it.
# Usage: source scripts/setup_env.sh   (or bash it; it leaves .venv ready either way)
#
# A finished setup leaves a stamp: a checksum of this script, the package's install files
# and the checkout's path. When the stamp matches and the package imports from this
# checkout, nothing is installed again (about a second). WITH_CONTRACT=1 also fetches
# SGLang's API contract file for the protocol tests (scripts/test.sh sets it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.setup-stamp"
stamp() {
  { pwd; echo "${TORCH_SPEC:-torch==2.13.0}"
    cat scripts/setup_env.sh pyproject.toml setup.py requirements*.txt; } | sha256sum | cut -d' ' -f1
}
ready() {
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp)" ] &&
    "$VENV/bin/python" -c "import megatron_grpo, sys; sys.exit(not megatron_grpo.__file__.startswith('$PWD/'))" 2>/dev/null
}
contract() {
  if [ "${WITH_CONTRACT:-0}" = 1 ]; then
    # SGLang's own msgspec contract (api_types.py) validates our client and embedded server.
    # Only that file is kept, under $VENV/share: sglang itself lives in .venv-sglang.
    "$VENV/bin/python" -m megatron_grpo.testing.sglang_contract >/dev/null
  fi
}
if ready; then
  contract
  if [ "${BASH_SOURCE[0]}" = "$0" ]; then exit 0; else return 0; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
rm -f "$STAMP"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
# torch first: on a machine without CUDA this takes the CPU wheel; any other torch
# request would pull a multi-GB CUDA build. On GPU machines set TORCH_SPEC as needed.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install --quiet -e ".[test]"
contract
stamp >"$STAMP"
