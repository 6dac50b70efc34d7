"""SGLang's own JSON contract for ``/generate``, to check our client and server against.

SGLang ships its HTTP contract as generated msgspec structs in
``sglang/api/v1/api_types.py``; the real server rejects a request that this
file rejects. The file imports only msgspec, so it is loaded by path from an
installed ``sglang`` distribution without importing the ``sglang`` package
(which would pull in torch and the whole runtime). Install it with::

    pip install msgspec && pip install --no-deps sglang==0.5.23
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SGLANG_VERSION = "0.5.23"
_CONTRACT_FILE = "sglang/api/v1/api_types.py"
_MODULE_NAME = "megatron_grpo.testing._sglang_api_types"
_INSTALL_HINT = f"pip install msgspec && pip install --no-deps sglang=={SGLANG_VERSION}"


class ContractUnavailableError(ImportError):
    """SGLang's contract file cannot be loaded (sglang or msgspec missing, or another version)."""


class ContractViolation(ValueError):
    """A JSON value breaks SGLang's contract: the real server would answer HTTP 400."""


def contract_path() -> Path:
    """Where the installed sglang keeps ``api_types.py``; raises ContractUnavailableError."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError as err:
        raise ContractUnavailableError(
            f"sglang is not installed, so SGLang's API contract cannot be loaded; "
            f"install it with: {_INSTALL_HINT}"
        ) from err
    if dist.version != SGLANG_VERSION:
        raise ContractUnavailableError(
            f"sglang {dist.version} is installed but the contract is pinned to "
            f"{SGLANG_VERSION}; install it with: {_INSTALL_HINT}"
        )
    path = Path(str(dist.locate_file(_CONTRACT_FILE)))
    if not path.is_file():
        raise ContractUnavailableError(f"sglang {dist.version} has no {_CONTRACT_FILE} at {path}")
    return path


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
            f"cannot load {path}: {err}; install its dependency with: {_INSTALL_HINT}"
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
