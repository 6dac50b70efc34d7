#!/usr/bin/env bash
# Set up a fresh machine (or reuse its .venv), lint, type-check and run the test suite,
# then the tier that runs a real SGLang 0.5.23 server on CPU (its own .venv-sglang).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WITH_CONTRACT=1 bash scripts/setup_env.sh
# The python tool's box (bubblewrap) is an OS package; its tests attack it for real.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq bubblewrap >/dev/null || { apt-get update -qq && apt-get install -y -qq bubblewrap; }
  else
    echo "test.sh: the sandbox tests need bubblewrap: install it (apt install bubblewrap)" >&2
    exit 1
  fi
fi
. "${VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
mypy
python -m pytest -q -p no:cacheprovider --durations=15 -m "not sglang" "$@"
# The real-SGLang tier: setup fails loudly (never a silent skip), and -m sglang makes
# its tests fail rather than skip if the server venv is missing.
bash scripts/setup_sglang_venv.sh
python -m pytest -q -p no:cacheprovider -m sglang -rA tests/sglang
