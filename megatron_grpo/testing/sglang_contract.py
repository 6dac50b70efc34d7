"""SGLang's own JSON contract for ``/generate``, to check our client and server against.

SGLang ships its HTTP contract as generated msgspec structs in
``sglang/api/v1/api_types.py``; the real server rejects a request that this
file rejects. The file imports only msgspec, so this environment keeps that
one file, taken from the sglang wheel, in ``<prefix>/share/megatron_grpo/``
and loads it by path: ``sglang`` itself is not installed here (the real
server has its own environment, ``scripts/setup_sglang_venv.sh``). Fetch it
once per environment (``scripts/setup_env.sh`` does) with::

    python -m megatron_grpo.testing.sglang_contract
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron_grpo.sglang_api.compat import SGLANG

SGLANG_VERSION = SGLANG.tested
_CONTRACT_FILE = "sglang/api/v1/api_types.py"
_MODULE_NAME = "megatron_grpo.testing._sglang_api_types"
_FETCH_HINT = "python -m megatron_grpo.testing.sglang_contract"
# sglang 0.5.23 publishes one wheel, for CPython 3.11 on x86-64 Linux; the contract file in it
# is plain Python, so that wheel serves any machine.
_WHEEL_TAGS = ("--python-version", "3.11", "--platform", "manylinux_2_34_x86_64")


class ContractUnavailableError(ImportError):
    """SGLang's contract file cannot be loaded (not fetched yet, or msgspec missing)."""


class ContractViolation(ValueError):
    """A JSON value breaks SGLang's contract: the real server would answer HTTP 400."""


def cache_path() -> Path:
    """Where this environment keeps the contract file: under its prefix, off the import path."""
    return Path(sys.prefix, "share", "megatron_grpo", f"sglang-{SGLANG_VERSION}", "api_types.py")


def contract_path() -> Path:
    """The fetched ``api_types.py``; raises ContractUnavailableError naming the fetch command."""
    path = cache_path()
    if not path.is_file():
        raise ContractUnavailableError(
            f"SGLang {SGLANG_VERSION}'s API contract is not at {path}; fetch it with: {_FETCH_HINT}"
        )
    return path


def fetch_contract() -> Path:
    """Download the sglang wheel (without dependencies) and keep only its contract file."""
    path = cache_path()
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory(prefix="sglang_wheel_") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            + ["--only-binary=:all:", *_WHEEL_TAGS, "--dest", tmp, f"sglang=={SGLANG_VERSION}"],
            check=True,
        )
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        source = contract_from_wheel(wheel)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # a reader never sees half a file
    partial.write_bytes(source)
    partial.replace(path)
    return path


def contract_from_wheel(wheel: Path) -> bytes:
    """The contract file's bytes from an sglang wheel."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(_CONTRACT_FILE)
        except KeyError:
            raise ContractUnavailableError(f"{wheel.name} has no {_CONTRACT_FILE}") from None


@functools.cache
def load_contract() -> ModuleType:
    """SGLang's ``api_types`` module, loaded once by file path."""
    path = contract_path()
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before running so that msgspec can resolve the module's own
    # (postponed) annotations by module name.
    sys.modules[_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        del sys.modules[_MODULE_NAME]
        raise ContractUnavailableError(
            f"cannot load {path}: {err}; install its dependency with: pip install msgspec"
        ) from err
    return module


def validate_request(body: Any) -> Any:
    """Decode a ``/generate`` body as SGLang's ``GenerateRequest``; raises ContractViolation."""
    return _decode("GenerateRequest", body)


def validate_response(value: Any) -> list[Any]:
    """Decode a ``/generate`` answer (one object, or a list for a batch or ``n > 1``)."""
    items = value if isinstance(value, list) else [value]
    return [_decode("GenerateResponse", item) for item in items]


def validate(type_name: str, value: Any) -> Any:
    """Decode ``value`` as any struct of the contract, e.g. ``"GetModelInfoResponse"``."""
    return _decode(type_name, value)


def _decode(type_name: str, value: Any) -> Any:
    contract = load_contract()
    try:
        return getattr(contract, type_name).from_json_value(value)
    except contract.JsonContractError as err:
        raise ContractViolation(f"{type_name} (sglang {SGLANG_VERSION}): {err}") from err


if __name__ == "__main__":
    print(fetch_contract())
    load_contract()  # msgspec is there and the file loads
