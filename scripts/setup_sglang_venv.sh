#!/usr/bin/env bash
# Create (or reuse) .venv-sglang: a real SGLang 0.5.23 server that runs on CPU, for the
# `sglang` test tier (tests/sglang). Separate from .venv: SGLang needs torch 2.14.1.
#
#   bash scripts/setup_sglang_venv.sh        # exits non-zero with a message if setup fails
#
# SGLang's GPU kernels (sglang-kernel) and its heavy optional dependencies are not installed:
# the package goes in with --no-deps, then the light runtime dependencies that
# `python -m sglang.launch_server --device cpu --attention-backend torch_native` imports,
# and tests/sglang_stub (an import-only stand-in for sgl_kernel) goes on PYTHONPATH.
# A finished setup leaves a stamp with this script's checksum; a later run with the same
# script only checks the imports.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.setup-stamp"
STUB="$PWD/tests/sglang_stub"

fail() {
  echo "setup_sglang_venv: FAILED: $*" >&2
  exit 1
}
trap 'fail "command on line $LINENO exited with status $?"' ERR

# Pinned to what was seen to start and serve on a CPU-only machine.
TORCH=(torch==2.14.1 torchvision==0.29.1)
SGLANG=sglang==0.5.23
RUNTIME=(
  aiohttp==3.14.5 apache-tvm-ffi==0.1.11 blobfile==3.0.0 compressed-tensors==0.18.0
  dill==0.4.1 distro==1.9.0 einops==0.8.2 fastapi==0.165.0 gguf==0.19.0 interegular==0.3.3
  ipython==9.18.1 llguidance==1.9.1 mistral_common==1.13.1 msgspec==0.23.0 numba==0.65.1
  openai==2.8.0 openai-harmony==0.0.4 orjson==3.13.0 outlines==0.1.11 packaging==26.4
  partial-json-parser==0.2.1.1.post7 prometheus_client==0.26.0 psutil==7.2.2 pybase64==1.5.1
  pydantic==2.14.4 "python-dateutil<3" python-multipart==0.0.34 pyzmq==27.3.0
  regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 scipy==1.17.1 sentencepiece==0.2.1
  setproctitle==1.3.8 soundfile==0.13.1 tiktoken==0.14.0 timm==1.0.25 tokenizers==0.23.2
  tqdm==4.70.1 transformers==5.19.0 triton==3.8.0 uvicorn==0.55.0 uvloop==0.23.0
  watchfiles==1.3.0 xgrammar==0.2.7 xxhash==4.1.0 zstandard==0.25.0
  sglang-router==0.3.2
)
# The modules a CPU server and the router load; an ImportError here means a missing dependency.
CHECK='
import sglang, sgl_kernel, sglang_router
import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.models.qwen2, sglang.srt.layers.attention.torch_native_backend
assert sglang.__version__ == "0.5.23", sglang.__version__
import torch; assert torch.__version__.split("+")[0] == "2.14.1", torch.__version__
'

checksum=$(sha256sum "${BASH_SOURCE[0]}" | cut -d" " -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$checksum" ] && [ -x "$VENV/bin/python" ]; then
  PYTHONPATH="$STUB" "$VENV/bin/python" -W ignore -c "$CHECK" || fail "$VENV is stamped but broken: rm -r $VENV and rerun"
  echo "setup_sglang_venv: $VENV ready (reused)"
  exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || fail "could not create $VENV with $PYTHON"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
rm -f "$STAMP"
echo "setup_sglang_venv: torch (${TORCH[*]})"
"${PIP[@]}" "${TORCH[@]}" || fail "pip could not install ${TORCH[*]} (Python $("$VENV/bin/python" -V))"
echo "setup_sglang_venv: ${#RUNTIME[@]} runtime dependencies"
"${PIP[@]}" "${RUNTIME[@]}" "${TORCH[@]}" || fail "pip could not install SGLang's runtime dependencies"
# Last, so that pip does not list the GPU dependencies it was told to leave out.
echo "setup_sglang_venv: $SGLANG (no dependencies)"
"${PIP[@]}" --no-deps "$SGLANG" || fail "pip could not install $SGLANG"
echo "setup_sglang_venv: checking imports"
PYTHONPATH="$STUB" "$VENV/bin/python" -W ignore -c "$CHECK" || fail "SGLang does not import in $VENV (see above)"
echo "$checksum" >"$STAMP"
echo "setup_sglang_venv: $VENV ready in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
