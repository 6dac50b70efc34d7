"""The CPU demo's assets, made once per session: a tiny model and the addition prompts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assets")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "cpu_demo" / "prepare.py"),
            "--out",
            str(out),
            "--warmup-steps",
            "30",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out
