"""End to end: `megatron-grpo compare-modes` on the length-bias example, 2 modes x 3 steps."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo.commands.compare.report import FIGURES
from megatron_grpo.metrics import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "length_bias"
MODES = ("token-mean", "seq-mean-token-mean")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("length_bias_assets")
    subprocess.run(
        [sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(out), "--warmup-steps", "20"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def compare_modes(out: Path, assets: Path) -> subprocess.CompletedProcess:
    tiny = (
        f"tokenizer={assets / 'model'}",
        f"train.init={assets / 'model'}",
        f"data.path={assets / 'train.jsonl'}",
        "train.total_steps=3",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
    )
    args = [
        sys.executable,
        "-m",
        "megatron_grpo.cli",
        "compare-modes",
        "--config",
        str(EXAMPLE / "grpo.yaml"),
        "--modes",
        ",".join(MODES),
        "--seeds",
        "1",
        "--nproc",
        "2",
        "--out",
        str(out),
        "--last-k",
        "2",
        "--window",
        "2",
        *[x for o in tiny for x in ("--set", o)],
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_compare_modes_writes_one_curve_per_mode_and_a_row_per_mode(tmp_path, assets):
    done = compare_modes(tmp_path, assets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seed = 1  # the example config's seed
    runs = {m: read_metrics(tmp_path / m / f"seed_{seed}") for m in MODES}
    assert all([r["step"] for r in rows] == [1, 2, 3] for rows in runs.values())

    with (tmp_path / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["mode"] for row in table] == list(MODES)
    for row in table:
        rewards = [r["rollout/reward_mean"] for r in runs[row["mode"]]]
        assert float(row["final_reward"]) == pytest.approx(sum(rewards[-2:]) / 2, abs=1e-4)
        assert row["num_seeds"] == "1" and row["num_failed"] == "0"
    assert "| token-mean | 1 |" in (tmp_path / "summary.md").read_text()

    plotted = json.loads((tmp_path / "series.json").read_text())
    for name, (key, _) in FIGURES.items():
        assert (tmp_path / f"{name}.png").stat().st_size > 1000, name
        assert plotted[name]["key"] == key
        assert set(plotted[name]["modes"]) == set(MODES), name  # one curve per mode
        for mode, curve in plotted[name]["modes"].items():
            # a step whose groups all have flat rewards logs no worse/better-than-group length
            logged = [r for r in runs[mode] if key in r]
            expected = [r[key] for r in logged]
            assert curve["steps"] == [r["step"] for r in logged] and logged, (name, mode)
            assert curve["mean"] == pytest.approx(expected, rel=1e-9), (name, mode)
            assert curve["per_seed"] == {str(seed): pytest.approx(expected, rel=1e-9)}

    # The same command again resumes: both runs are finished, so nothing trains.
    again = compare_modes(tmp_path, assets)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": reused (") == len(MODES), again.stdout[-2000:]
