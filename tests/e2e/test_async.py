"""Asynchronous RL (rollout.max_staleness): the synchronous loop unchanged at k = 0, the
staleness bound at k >= 1, and what a resumed asynchronous run generates."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_run import ROOT, demo_argv

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

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
    RL was built (three steps of the demo; times left out). The rollout's are exact; the
    learner's floats to 1e-4, since CPUs with other vector units (AVX2, AVX-512) round
    the same sums differently in their last bits."""
    rows = train(tmp_path, assets, "train.total_steps=3", "rollout.max_staleness=0")
    expected = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(rows) >= len(expected)
    for row, want in zip(rows, expected):
        exact = {k: v for k, v in want.items() if not k.startswith("train/")}
        assert {k: row[k] for k in exact} == exact
        learner = {k: v for k, v in want.items() if k.startswith("train/")}
        assert {k: row[k] for k in learner} == pytest.approx(learner, rel=1e-4, abs=1e-6)


def prompts(dump: Path, step: int) -> list[list[int]]:
    """The prompt tokens of each sample a step trained on (its leading masked tokens)."""
    out = []
    for line in (dump / f"step_{step:08d}.jsonl").read_text().splitlines()[1:]:
        row = json.loads(line)
        out.append(row["tokens"][: row["loss_mask"].index(1.0)])
    return out


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
        if b"megatron_grpo.embedded" in argv:
            found.append(pid)
    return sorted(found)


def train_killing_an_engine(out: Path, assets: Path, *overrides: str) -> tuple[list[dict], str]:
    """A run with two embedded server processes, the first killed (kill -9) once step 2 is
    logged: its metrics and its output."""
    argv = demo_argv(
        out, assets, *ONE_PROCESS, "rollout.engines.num_servers=2", *overrides, nproc=1
    )
    trainer = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(engine_pids(trainer)[0], signal.SIGKILL)
        output, _ = trainer.communicate(timeout=240)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0, output[-5000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()], output


def test_staleness_within_k_a_killed_engine_started_again_and_resume(tmp_path, assets):
    """max_staleness 2 on two embedded server processes, one killed mid-run: no sample is
    more than 2 versions old, and some are; generation goes on with the other engine and
    the next push starts the dead one again; a run resumed from a checkpoint saved while
    the producer was ahead draws the same prompts for the later steps."""
    k = 2
    # Three optimizer passes a step: the learner is slower than generation, so the producer
    # runs ahead until the bound holds it.
    common = (
        *ASYNC,
        f"rollout.max_staleness={k}",
        "train.num_iterations=3",
        "train.save_interval=2",
        "train.keep_last=3",
    )
    full, logs = tmp_path / "full", tmp_path / "engine_logs"
    rows, output = train_killing_an_engine(
        full,
        assets,
        *common,
        "train.total_steps=6",
        f"rollout.dump_dir={full}/dump",
        f"rollout.engines.log_dir={logs}",
    )
    assert [row["step"] for row in rows] == list(range(1, 7))
    ages = [row["rollout/staleness_max"] for row in rows]
    assert max(ages) <= k and ages[0] == 0  # step 1 trains the initial policy's rollout
    assert max(ages) >= 1  # the producer ran ahead (how far depends on timing)
    assert all(0 <= row["rollout/staleness_mean"] <= k for row in rows)
    assert "exited with code -9; starting it again" in output
    log = (logs / "server_0.log").read_text().splitlines()
    assert len([line for line in log if line.startswith("$ ")]) == 2  # started twice

    cut = tmp_path / "cut"
    saved = "step_00000002"
    shutil.copytree(full / "checkpoints" / saved, cut / "checkpoints" / saved)
    (cut / "checkpoints" / "latest").write_text(saved)
    resumed = train(cut, assets, *common, "train.total_steps=6", f"rollout.dump_dir={cut}/dump")
    assert [row["step"] for row in resumed] == [3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert prompts(cut / "dump", step) == prompts(full / "dump", step)


def test_a_killed_producer_stops_the_run_naming_it(tmp_path, assets):
    """kill -9 of the rollout producer's process once step 1 is logged: the run stops with
    an error that says so, and the steps it trained stay logged. The math reward scores in
    the producer's process itself (no reward workers): its time limit needs a main thread."""
    out, log = tmp_path / "run", tmp_path / "output.txt"
    argv = demo_argv(
        out,
        assets,
        *ONE_PROCESS,
        "advantages.dynamic_sampling=false",
        "rollout.max_staleness=1",
        "train.total_steps=30",
        nproc=1,
    )
    with log.open("w") as sink:
        trainer = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            metrics = out / "metrics.jsonl"
            deadline = time.monotonic() + 240
            while not (metrics.exists() and metrics.read_text().strip()):
                assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            found = re.search(r"rollout producer process (\d+)", log.read_text())
            assert found, log.read_text()[-3000:]
            os.kill(int(found.group(1)), signal.SIGKILL)
            trainer.wait(timeout=240)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    output = log.read_text()
    assert trainer.returncode != 0, output[-3000:]
    assert "the rollout producer's process exited (exit code -9)" in output, output[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) < 30 and rows[0]["step"] == 1
