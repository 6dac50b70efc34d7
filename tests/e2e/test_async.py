"""Asynchronous RL (rollout.max_staleness): the synchronous loop unchanged at k = 0, the
staleness bound at k >= 1, and what a resumed asynchronous run generates."""

from __future__ import annotations

import json
import shutil
import subprocess
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
