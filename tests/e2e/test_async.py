"""Asynchronous RL (rollout.max_staleness): the synchronous loop unchanged at k = 0, the
staleness bound at k >= 1, and what a resumed asynchronous run generates."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_run import ROOT, demo_argv

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FIXTURE = ROOT / "tests" / "fixtures" / "sync_metrics.jsonl"
ONE_PROCESS = ("parallel.pp=1",)
ASYNC = ("reward.num_workers=1", "advantages.dynamic_sampling=false")


def train(out: Path, assets: Path, *overrides: str) -> list[dict]:
    args = demo_argv(out, assets, *ONE_PROCESS, *overrides, nproc=1)
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_staleness_0_reproduces_the_synchronous_loop_s_metrics(tmp_path, assets):
    """The fixture holds the metrics of the synchronous loop as it was before asynchronous
    RL was built (three steps of the demo; times left out)."""
    rows = train(tmp_path, assets, "train.total_steps=3", "rollout.max_staleness=0")
    expected = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert [{k: row[k] for k in want} for row, want in zip(rows, expected)] == expected


def prompts(dump: Path, step: int) -> list[list[int]]:
    """The prompt tokens of each sample a step trained on (its leading masked tokens)."""
    out = []
    for line in (dump / f"step_{step:08d}.jsonl").read_text().splitlines()[1:]:
        row = json.loads(line)
        out.append(row["tokens"][: row["loss_mask"].index(1.0)])
    return out


def test_staleness_stays_within_k_and_a_resumed_run_draws_the_same_prompts(tmp_path, assets):
    k = 2
    common = (*ASYNC, f"rollout.max_staleness={k}", "train.save_interval=2", "train.keep_last=3")
    full = tmp_path / "full"
    rows = train(full, assets, *common, "train.total_steps=5", f"rollout.dump_dir={full}/dump")
    ages = [row["rollout/staleness_max"] for row in rows]
    assert max(ages) <= k and ages[0] == 0  # step 1 trains the initial policy's rollout
    assert max(ages) == k  # the producer ran ahead as far as it may
    assert all(0 <= row["rollout/staleness_mean"] <= k for row in rows)

    # Resumed from the checkpoint of step 2, saved while the producer was ahead (it had
    # made step 3's batch, and more): the resumed run draws step 3's prompts again.
    cut = tmp_path / "cut"
    saved = "step_00000002"
    shutil.copytree(full / "checkpoints" / saved, cut / "checkpoints" / saved)
    (cut / "checkpoints" / "latest").write_text(saved)
    resumed = train(cut, assets, *common, "train.total_steps=5", f"rollout.dump_dir={cut}/dump")
    assert [row["step"] for row in resumed] == [3, 4, 5]
    for step in (3, 4, 5):
        assert prompts(cut / "dump", step) == prompts(full / "dump", step)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        out += children
        frontier = children
    return out


def engine_pids(trainer: subprocess.Popen) -> list[int]:
    """The trainer's embedded server processes, in the order they were started."""
    found = []
    for pid in descendants(trainer.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_grpo.rollout.embedded" in argv:
            found.append(pid)
    return sorted(found)


def test_a_killed_engine_is_dropped_and_started_again(tmp_path, assets):
    """kill -9 of one of two embedded server processes mid-run: generation goes on with the
    other, the next weight push starts the dead one again and gives it the weights."""
    logs = tmp_path / "engine_logs"
    overrides = (
        *ONE_PROCESS,
        *ASYNC,
        "rollout.max_staleness=1",
        "rollout.num_servers=2",
        f"rollout.server_log_dir={logs}",
        "train.total_steps=8",
        "train.save_interval=0",
    )
    argv = demo_argv(tmp_path / "run", assets, *overrides, nproc=1)
    trainer = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        victim = engine_pids(trainer)[0]
        os.kill(victim, signal.SIGKILL)
        out, _ = trainer.communicate(timeout=240)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0, out[-5000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(
        range(1, 9)
    )
    assert "exited with code -9; starting it again" in out
    started = [
        line for line in (logs / "server_0.log").read_text().splitlines() if line[:2] == "$ "
    ]
    assert len(started) == 2
