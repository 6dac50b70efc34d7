#!/usr/bin/env bash
# Set up (or reuse) the GPU tier's two environments on a machine with an NVIDIA GPU:
#   .venv-gpu          the trainer: a CUDA build of torch (TORCH_SPEC), this package with its
#                      test extra, Transformer Engine from requirements-gpu.txt (its PyTorch
#                      extension built from source against that torch: needs nvcc)
#   .venv-sglang-gpu   SGLang 0.5.23 with its own dependencies and its own torch
#
#   bash scripts/setup_gpu_env.sh [--dry-run]
#
# Each step leaves a stamp (a checksum of this script and the step's inputs) in its
# environment; a step whose stamp matches is not run again, so a warm call only checks the
# imports (about 20 s). Downloads and the wheel pip builds for Transformer Engine stay in
# pip's cache, MGRPO_GPU_CACHE (default ~/.cache/megatron_grpo_gpu), so rebuilding an
# environment downloads and compiles nothing again. pip's own variables work as usual: a
# machine without the package index can install from a wheelhouse (PIP_FIND_LINKS=DIR,
# PIP_NO_INDEX=1). --dry-run prints what would be installed and what is cached, and
# installs nothing.
#
# Cold cost (estimates, not yet measured): torch and its CUDA libraries about 3 GB,
# SGLang's dependencies about 4 GB more (the same torch comes from the cache), and the
# Transformer Engine extension's build (minutes; MAX_JOBS, NVTE_CUDA_ARCHS set here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PYTHON=${PYTHON:-python3}
VENV=${GPU_VENV:-.venv-gpu}
SGL_VENV=${SGLANG_GPU_VENV:-.venv-sglang-gpu}
CACHE=${MGRPO_GPU_CACHE:-$HOME/.cache/megatron_grpo_gpu}
# PyPI's Linux wheels of torch are CUDA builds; 2.14.1 is what SGLang 0.5.23 pins, so both
# environments share one download. Another CUDA: e.g. TORCH_SPEC="torch==2.14.1 --index-url URL".
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
SELF=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)

say() { echo "setup_gpu_env: $*"; }
fail() {
  echo "setup_gpu_env: FAILED: $*" >&2
  exit 1
}
stamp_of() { # step name -> the checksum a finished step leaves: this script, the step's
  # KEY (the specs it installs) and the contents of its INPUTS (files)
  { echo "$SELF $1 $KEY"; for f in "${INPUTS[@]}"; do [ -f "$f" ] && cat "$f"; done; } |
    sha256sum | cut -d' ' -f1
}
done_already() { [ -f "$1/.stamp-$2" ] && [ "$(cat "$1/.stamp-$2")" = "$3" ]; }
mark() { echo "$3" >"$1/.stamp-$2"; }

step() { # venv, step name, description, command...; runs the command unless stamped
  local venv=$1 name=$2 what=$3
  shift 3
  local want
  want=$(stamp_of "$name")
  if done_already "$venv" "$name" "$want"; then
    say "$name: cached ($what)"
    return 0
  fi
  if [ "$DRY" = 1 ]; then
    say "$name: would install $what"
    return 0
  fi
  say "$name: installing $what"
  local start
  start=$(date +%s)
  "$@" || fail "$name: $what"
  mark "$venv" "$name" "$want"
  say "$name: done in $(($(date +%s) - start)) s"
}

gpu_arch() { # e.g. 90 for an H100 or H200
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .'
}

if [ "$DRY" = 1 ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    say "GPU: $(nvidia-smi -L | head -1)"
  else
    say "no NVIDIA GPU visible here (nvidia-smi absent or failing): a real run stops at this check"
  fi
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 ||
    fail "no NVIDIA GPU visible (nvidia-smi absent or failing): the GPU tier needs one"
  mkdir -p "$CACHE/pip"
  export PIP_CACHE_DIR="$CACHE/pip"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "could not create $VENV"
  [ -x "$SGL_VENV/bin/python" ] || "$PYTHON" -m venv "$SGL_VENV" || fail "could not create $SGL_VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
SGL_PIP=("$SGL_VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# 1. torch, a CUDA build
KEY=$TORCH_SPEC INPUTS=()
step "$VENV" torch "$TORCH_SPEC (CUDA build; with pip, setuptools, wheel, ninja, pybind11)" \
  bash -c "$(printf '%q ' "${PIP[@]}") --upgrade pip setuptools wheel ninja pybind11 && $(printf '%q ' "${PIP[@]}") $TORCH_SPEC"

# 2. this package and its test extra (megatron-core, transformers, pytest, ...)
KEY=$TORCH_SPEC INPUTS=(pyproject.toml setup.py requirements.txt requirements-test.txt)
step "$VENV" project "this package, editable, with requirements.txt and requirements-test.txt" \
  "${PIP[@]}" -e ".[test]"

# 3. Transformer Engine, its core for torch's CUDA major, the extension built from source
KEY=$TORCH_SPEC INPUTS=(requirements-gpu.txt) # built against that torch: rebuilt with it
te_install() {
  local cuda major arch
  cuda=$("$VENV/bin/python" -c "import torch; print(torch.version.cuda or '')")
  [ -n "$cuda" ] || fail "torch in $VENV is not a CUDA build ($TORCH_SPEC): set TORCH_SPEC"
  major=${cuda%%.*}
  arch=$(gpu_arch)
  if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    fail "Transformer Engine's PyTorch extension builds from source and needs the CUDA toolkit \
(nvcc; set CUDA_HOME), CUDA $major like torch; or use a container that ships Transformer Engine"
  fi
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
  NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-$arch}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "${PIP[@]}" --no-build-isolation -r requirements-gpu.txt \
    "transformer-engine[core_cu$major]$(sed -n 's/^transformer-engine\[pytorch\]//p' requirements-gpu.txt)"
}
step "$VENV" transformer_engine "$(grep -v '^#' requirements-gpu.txt) + the core for torch's CUDA major \
(extension built with nvcc for this GPU's arch)" te_install

# 4. SGLang in its own environment
KEY=$SGLANG_SPEC INPUTS=()
step "$SGL_VENV" sglang "$SGLANG_SPEC with its dependencies (its torch: 2.14.1)" \
  "${SGL_PIP[@]}" "$SGLANG_SPEC"

[ "$DRY" = 1 ] && exit 0
say "checking imports"
"$VENV/bin/python" - <<'PY' || fail "the trainer's environment does not import (see above)"
import torch, transformer_engine, transformer_engine.pytorch, megatron.core, megatron_grpo
assert torch.cuda.is_available(), "torch sees no GPU"
print(f"setup_gpu_env: trainer: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformer_engine {transformer_engine.__version__}, {torch.cuda.get_device_name(0)}")
PY
"$SGL_VENV/bin/python" - <<'PY' || fail "SGLang's environment does not import (see above)"
import sglang, sglang.launch_server, torch
assert torch.cuda.is_available(), "torch sees no GPU"
print(f"setup_gpu_env: sglang {sglang.__version__}, its torch {torch.__version__}")
PY
