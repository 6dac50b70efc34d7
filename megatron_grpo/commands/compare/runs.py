"""compare-modes' runs: one ``megatron-grpo train`` subprocess per (mode, seed).

A mode is a loss mode (``loss.mode=<mode>``) or a named variant, a list of overrides of
its own (``--variant``). A run lives in ``OUT/<mode>/seed_<S>`` with its log in ``train.log``. A run
whose ``metrics.jsonl`` already covers every step is reused, so an
interrupted comparison resumes; a run that fails is reported, not raised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_grpo.metrics import read_metrics

Status = Literal["trained", "reused", "failed"]


@dataclass
class RunResult:
    mode: str
    seed: int
    run_dir: Path
    status: Status
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The run's metrics, one row per step (a resumed run's repeated steps: the last one)."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"


def run_dir_of(out: Path, mode: str, seed: int) -> Path:
    return out / mode / f"seed_{seed}"


def finished_rows(run_dir: Path, total_steps: int) -> list[dict[str, Any]] | None:
    """The run's metrics if they cover steps 1..total_steps, else None."""
    try:
        rows = read_metrics(run_dir)
    except (FileNotFoundError, ValueError):  # missing, or a line cut by a crash
        return None
    by_step = {r["step"]: r for r in rows if "step" in r}  # the last row of a step wins
    if not set(range(1, total_steps + 1)) <= set(by_step):
        return None
    return [by_step[s] for s in range(1, total_steps + 1)]


def train_command(
    config: str | None,
    overrides: Sequence[str],
    arm: Sequence[str],
    seed: int,
    run_dir: Path,
    nproc: int,
) -> list[str]:
    """The command of one run: the common overrides, then the mode's own (``arm``)."""
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", str(nproc)]
    if config:
        cmd += ["--config", config]
    ours = [*arm, f"seed={seed}", f"output_dir={run_dir}"]
    for item in [*overrides, *ours]:  # ours come last, so they win
        cmd += ["--set", item]
    return cmd


def _run_logged(cmd: list[str], log: Path, timeout: float | None) -> str:
    """Run ``cmd`` with its output in ``log``; the error (empty when it succeeded)."""
    with log.open("w") as f:
        # Its own session: on a timeout the whole tree (torchrun and its workers) is killed.
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException as e:  # a timeout, or Ctrl-C: leave no worker behind
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                return f"timed out after {timeout:g} s"
            raise
    return f"exit code {code}" if code else ""


def run_one(
    *,
    config: str | None,
    overrides: Sequence[str],
    mode: str,
    arm: Sequence[str],
    seed: int,
    out: Path,
    total_steps: int,
    nproc: int,
    timeout: float | None,
) -> RunResult:
    """Train one (mode, seed), or reuse it if it already finished."""
    run_dir = run_dir_of(out, mode, seed)
    rows = finished_rows(run_dir, total_steps)
    if rows is not None:
        return RunResult(mode, seed, run_dir, "reused", rows)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "train.log"
    error = _run_logged(train_command(config, overrides, arm, seed, run_dir, nproc), log, timeout)
    rows = finished_rows(run_dir, total_steps)
    if not error and rows is None:
        error = f"metrics.jsonl does not cover steps 1..{total_steps}"
    if error:
        return RunResult(mode, seed, run_dir, "failed", error=f"{error}; log: {log}")
    assert rows is not None
    return RunResult(mode, seed, run_dir, "trained", rows)
