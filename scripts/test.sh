#!/usr/bin/env bash
# Set up a fresh machine (or reuse its .venv), lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
. "${VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
mypy
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
