"""Where SGLang's contract file comes from: one file of the sglang wheel, kept in this env.

The contract's own checks run in test_rollout_protocol.py, test_rollout_client.py
and test_rollout_server.py.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from megatron_grpo.testing import sglang_contract as contract

pytestmark = pytest.mark.timeout(60)

CONTRACT_FILE = "sglang/api/v1/api_types.py"
CONTRACT_SOURCE = b"import msgspec\n\nclass GenerateRequest(msgspec.Struct):\n    pass\n"


def fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_the_loaded_contract_is_the_fetched_file():
    module = contract.load_contract()
    assert Path(module.__file__) == contract.cache_path() == contract.contract_path()
    assert hasattr(module, "GenerateRequest") and hasattr(module, "GenerateResponse")


def test_an_unfetched_contract_names_the_command_that_fetches_it(monkeypatch, tmp_path):
    monkeypatch.setattr(contract, "cache_path", lambda: tmp_path / "api_types.py")
    with pytest.raises(contract.ContractUnavailableError) as err:
        contract.contract_path()
    assert str(err.value) == (
        f"SGLang 0.5.23's API contract is not at {tmp_path / 'api_types.py'}; "
        "fetch it with: python -m megatron_grpo.testing.sglang_contract"
    )


def test_fetch_keeps_only_the_contract_file_of_the_wheel(monkeypatch, tmp_path):
    cached = tmp_path / "share" / "api_types.py"
    monkeypatch.setattr(contract, "cache_path", lambda: cached)
    commands: list[list[str]] = []

    def pip_download(cmd, check):
        commands.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        files = {"sglang/__init__.py": b"import torch\n", CONTRACT_FILE: CONTRACT_SOURCE}
        fake_wheel(dest / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", files)

    monkeypatch.setattr(contract.subprocess, "run", pip_download)
    assert contract.fetch_contract() == cached
    assert cached.read_bytes() == CONTRACT_SOURCE
    assert sorted(p.name for p in cached.parent.iterdir()) == ["api_types.py"]
    (cmd,) = commands
    assert cmd[cmd.index("download") :][-1] == "sglang==0.5.23" and "--no-deps" in cmd
    assert contract.fetch_contract() == cached and len(commands) == 1  # fetched once


def test_a_wheel_without_the_contract_is_refused_by_name(tmp_path):
    wheel = fake_wheel(tmp_path / "sglang-0.5.23-py3-none-any.whl", {"sglang/__init__.py": b""})
    with pytest.raises(contract.ContractUnavailableError, match="has no sglang/api/v1/api_types"):
        contract.contract_from_wheel(wheel)
