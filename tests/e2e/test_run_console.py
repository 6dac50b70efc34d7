"""A run as its user sees it from the console: how it starts (fresh, resumed, complete,
refused), what it prints, and how it ends when stopped with Ctrl-C. The real command
line, run as a subprocess."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_run import ROOT, demo_argv

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def snapshot(out: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``out``: its checksum and modification time."""
    return {
        str(p.relative_to(out)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def test_a_run_says_how_it_starts_and_a_resume_keeps_the_config_it_trained(tmp_path, assets):
    out = tmp_path / "run"
    first = run(demo_argv(out, assets, "train.total_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    console = (first.stdout + first.stderr).splitlines()
    assert console[0] == f"megatron-grpo: starting a new run in {out} (2 steps)"
    # quiet: no config dump, no third-party warnings, nothing but a summary and the steps
    others = [line for line in console if not line.startswith("step ")]
    assert len(others) <= 8, "\n".join(others)
    assert not [line for line in console if "Warning" in line or "warnings.warn" in line]

    before = snapshot(out)
    again = run(demo_argv(out, assets, "train.total_steps=2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == (
        f"megatron-grpo: the run in {out} is complete (step 2 of 2); nothing to train. "
        "Raise train.total_steps to go on, or set another output_dir\n"
    )
    assert snapshot(out) == before  # not a byte, not a time stamp

    changed = run(demo_argv(out, assets, "train.total_steps=3", "optim.lr=1e-4"))
    assert changed.returncode == 2
    assert changed.stderr.count("\n") == 1 and "differs in optim.lr (0.001 -> 0.0001)" in (
        changed.stderr
    )
    assert snapshot(out) == before

    allowed = run(demo_argv(out, assets, "train.total_steps=3", "optim.lr=1e-4")
                  + ["--allow-config-change"])  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert allowed.stdout.splitlines()[0] == (
        f"megatron-grpo: resuming the run in {out} from step 2 ({out}/checkpoints/"
        "step_00000002) to step 3; optim.lr: 0.001 -> 0.0001; train.total_steps: 2 -> 3"
    )
    assert snapshot(out)["config.yaml"] == before["config.yaml"]  # the first config, kept
    assert "lr: 0.0001" in (out / "config.resume_step_00000002.yaml").read_text()


def test_ctrl_c_ends_with_one_line_naming_the_checkpoint_and_the_command(tmp_path, assets):
    out = tmp_path / "run"
    argv = demo_argv(out, assets, "train.total_steps=400", "train.save_interval=1")
    # A terminal's Ctrl-C: SIGINT to the launcher's whole process group.
    process = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    (last,) = stderr.strip().splitlines()[-1:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert last.startswith(
        f"megatron-grpo: stopped (Ctrl-C); the last checkpoint is {out}/checkpoints/{latest}; "
        "the same command resumes: megatron-grpo train --config "
    )
    assert "Received" not in stderr and "death signal" not in stderr
