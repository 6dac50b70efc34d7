"""Every benchmark script in its --quick mode prints its ratio and writes valid JSON.

They launch gloo processes (most of them), hence ``distributed``. Each launch
has a hard timeout, below which the scripts' own worker timeouts sit, so a
hang fails the test and leaves no process behind. ``bench/gpu.sh`` is run
with CUDA hidden: it must say that no GPU is present, write a JSON saying so
and exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = (
    "packing",
    "rollout",
    "weight_sync",
    "collectives",
    "loss_overhead",
    "memory",
    "async_rl",
    "checkpoint_save",
)


def _strict_json(path: Path) -> dict:
    def refuse(constant: str):
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{argv}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("name", SCRIPTS)
def test_quick_mode_prints_its_ratio_and_writes_json(name, tmp_path):
    out = tmp_path / f"{name}.json"
    done = _run([sys.executable, f"bench/{name}.py", "--quick", "--out", str(out)])
    assert "RATIO" in done.stdout, done.stdout
    result = _strict_json(out)
    assert result["bench"] == name
    assert result["quick"] is True
    assert result["machine"]["cpu_count"] >= 1


def test_vs_trl_quick_mode_prints_its_ratios_and_writes_json(tmp_path):
    pytest.importorskip("trl")  # an optional bench dependency
    assets = tmp_path / "assets"
    _run(
        [
            sys.executable,
            "examples/cpu_demo/prepare.py",
            "--out",
            str(assets),
            "--warmup-steps",
            "1",
        ]
    )
    out = tmp_path / "vs_trl.json"
    argv = [
        sys.executable,
        "bench/vs_trl.py",
        "--quick",
        "--assets",
        str(assets),
        "--out",
        str(out),
    ]
    done = _run(argv + ["--steps", "3"])
    assert "RATIO pp1_s_per_step/trl_s_per_step [wall]" in done.stdout, done.stdout
    result = _strict_json(out)
    assert set(result["sides"]) == {"trl", "pp1", "pp2"}


def test_gpu_sh_without_a_gpu_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = _run(["bash", "bench/gpu.sh", str(out)], env=env)
    assert "no GPU present" in done.stdout
    result = _strict_json(out)
    assert result["gpu"] is False and result["bench"] == "gpu"
