"""compare-modes: the summary maths on hand-made metrics, resuming, failed runs, the report."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_grpo.cli import main
from megatron_grpo.commands.compare import compare_modes
from megatron_grpo.commands.compare import runs as compare_runs
from megatron_grpo.commands.compare.report import (
    FIGURES,
    aggregate,
    final_mean,
    length_growth,
    moving_average,
    steps_to_threshold,
    summarize,
)
from megatron_grpo.commands.compare.runs import RunResult, finished_rows, train_command


def rows_of(rewards, lengths, truncated=None):
    truncated = truncated or [0.0] * len(rewards)
    return [
        {
            "step": i + 1,
            "rollout/reward_mean": r,
            "rollout/response_length_mean": n,
            "rollout/response_length_pos_adv_mean": n - 1,
            "rollout/response_length_neg_adv_mean": n + 1,
            "rollout/truncated_fraction": t,
            "train/grad_norm": 1.0 + i,
            "train/kl": 0.01 * i,
        }
        for i, (r, n, t) in enumerate(zip(rewards, lengths, truncated))
    ]


def write_metrics(run_dir: Path, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_moving_average_uses_full_windows_only():
    assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert moving_average([1, 2], 3) == []


def test_steps_to_threshold():
    steps = [1, 2, 3, 4, 5, 6]
    rewards = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    # trailing 3-step means: steps 3..6 -> 0.5, 1.0, 1.5, 2.0
    assert steps_to_threshold(steps, rewards, 1.0, 3) == 4
    assert steps_to_threshold(steps, rewards, 1.2, 3) == 5
    assert steps_to_threshold(steps, rewards, 0.5, 1) == 2  # window 1: the raw curve
    assert steps_to_threshold(steps, rewards, 2.1, 3) is None
    assert steps_to_threshold(steps[:2], rewards[:2], 0.0, 3) is None  # shorter than a window
    # a noisy spike does not count before the window is full
    assert steps_to_threshold([1, 2, 3], [1.0, 0.0, 0.0], 0.6, 2) is None


def test_final_mean_and_length_growth():
    lengths = [10.0, 12.0, 14.0, 16.0, 30.0, 32.0]
    assert final_mean(lengths, 2) == 31.0
    assert final_mean(lengths, 100) == pytest.approx(19.0)
    assert length_growth(lengths, 2) == pytest.approx(31.0 / 11.0)
    assert length_growth([4.0, 2.0], 1) == 0.5
    assert math.isnan(length_growth([0.0, 1.0], 1))


def test_aggregate_mean_and_spread_over_seeds_on_common_steps():
    per_seed = {
        1: rows_of([0.0, 0.2, 0.4], [10, 10, 10]),
        2: rows_of([0.2, 0.6, 0.8, 0.9], [10, 10, 10, 10]),  # one step more
    }
    s = aggregate(per_seed, "rollout/reward_mean")
    assert s is not None
    assert s.steps == [1, 2, 3]
    assert s.mean == pytest.approx([0.1, 0.4, 0.6])
    assert s.low == pytest.approx([0.0, 0.2, 0.4])
    assert s.high == pytest.approx([0.2, 0.6, 0.8])
    assert s.std == pytest.approx([0.1, 0.2, 0.2])
    assert s.per_seed == {1: [0.0, 0.2, 0.4], 2: [0.2, 0.6, 0.8]}
    assert aggregate(per_seed, "no_such_metric") is None
    assert aggregate({}, "rollout/reward_mean") is None


def test_summary_of_a_mode_over_seeds_with_a_failed_run(tmp_path):
    runs = [
        RunResult("m", 1, tmp_path, "trained", rows_of([0.0, 0.2, 0.4, 0.6], [10, 10, 20, 30])),
        RunResult("m", 2, tmp_path, "reused", rows_of([0.2, 0.4, 0.6, 0.8], [20, 20, 20, 20])),
        RunResult("m", 3, tmp_path, "failed", error="exit code 1"),
    ]
    s = summarize("m", runs, k=2, threshold=0.5, window=2)
    assert (s.num_seeds, s.num_failed) == (2, 1)
    assert s.final_reward == pytest.approx((0.5 + 0.7) / 2)
    assert s.final_reward_std == pytest.approx(0.1)
    assert s.length_first == pytest.approx((10 + 20) / 2)
    assert s.length_last == pytest.approx((25 + 20) / 2)
    assert s.length_growth == pytest.approx((2.5 + 1.0) / 2)
    assert s.length_growth_std == pytest.approx(0.75)
    assert s.neg_length_first == pytest.approx((11 + 21) / 2)  # each length + 1 in rows_of
    assert s.neg_length_last == pytest.approx((26 + 21) / 2)
    # seed-mean rewards 0.1, 0.3, 0.5, 0.7; 2-step means reach 0.5 at step 4 (0.6)
    assert s.steps_to_threshold == 4
    assert s.steps_to_threshold_per_seed == [4, 3]


def test_summary_of_a_mode_whose_runs_all_failed(tmp_path):
    s = summarize(
        "m", [RunResult("m", 1, tmp_path, "failed", error="x")], k=2, threshold=0.5, window=2
    )
    assert (s.num_seeds, s.num_failed, s.steps_to_threshold) == (0, 1, None)
    assert math.isnan(s.final_reward)


def test_finished_rows_needs_every_step_and_keeps_the_last_row_of_a_step(tmp_path):
    assert finished_rows(tmp_path, 3) is None  # no metrics yet
    write_metrics(tmp_path, rows_of([0.1, 0.2], [5, 5]))
    assert finished_rows(tmp_path, 3) is None  # stopped early
    # a run resumed from step 1's checkpoint logs step 2 again: the last row wins
    rows = rows_of([0.1, 0.2], [5, 5]) + rows_of([0.1, 0.25, 0.3], [5, 6, 7])[1:]
    write_metrics(tmp_path, rows)
    got = finished_rows(tmp_path, 3)
    assert got is not None
    assert [r["rollout/reward_mean"] for r in got] == [0.1, 0.25, 0.3]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # a line cut by a crash
    assert finished_rows(tmp_path, 3) is None


def test_train_command_sets_mode_seed_and_output_dir_last(tmp_path):
    arm = ["loss.mode=token-mean"]
    cmd = train_command("c.yaml", ["seed=9", "optim.lr=1e-4"], arm, 3, tmp_path, 2)
    assert cmd[1:5] == ["-m", "megatron_grpo.cli", "train", "--nproc"]
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets == [
        "seed=9",
        "optim.lr=1e-4",
        "loss.mode=token-mean",
        "seed=3",
        f"output_dir={tmp_path}",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variant", "async"], "--variant takes NAME:KEY=VALUE, got 'async'"),
        (["--variant", "a:x=1", "--modes", "token-mean"], "give --modes or --variant, not both"),
    ],
)
def test_bad_variants_are_refused(capsys, argv, message):
    from megatron_grpo.cli import main

    assert main(["compare-modes", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_run_that_hangs_is_stopped_at_its_timeout(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"]
    assert compare_runs._run_logged(cmd, tmp_path / "log", 2.0) == "timed out after 2 s"
    assert "started" in (tmp_path / "log").read_text()


def fake_trainer(failing_mode: str, calls: list):
    """Stands in for ``_run_logged``: writes 6 steps of metrics whose numbers name the run."""

    def run(cmd, log, timeout):
        sets = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd) if a == "--set")
        calls.append((sets["loss.mode"], int(sets["seed"])))
        log.write_text("training\n")
        if sets["loss.mode"] == failing_mode:
            write_metrics(Path(sets["output_dir"]), rows_of([0.1, 0.2], [5, 5]))
            return "exit code 1"
        offset = 0.1 * int(sets["seed"]) + (0.5 if sets["loss.mode"] == "token-mean" else 0.0)
        rewards = [offset + 0.01 * i for i in range(6)]
        write_metrics(Path(sets["output_dir"]), rows_of(rewards, [10, 11, 12, 13, 14, 15]))
        return ""

    return run


def test_compare_modes_reports_a_failed_run_and_resumes(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(compare_runs, "_run_logged", fake_trainer("group-seq-mean", calls))
    modes = ["token-mean", "seq-mean-token-mean", "group-seq-mean"]
    kwargs = dict(config=None, modes=modes, num_seeds=2, out=tmp_path, k=2, window=2)
    result = compare_modes(overrides=["train.total_steps=6", "seed=1"], **kwargs)
    # seed-major order: every mode of the first seed before the second seed
    assert calls == [(m, s) for s in (1, 2) for m in modes]
    assert [(r.mode, r.seed) for r in result.failed] == [
        ("group-seq-mean", 1),
        ("group-seq-mean", 2),
    ]
    with (tmp_path / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["mode"] for row in table] == modes  # one row per mode, the failed one too
    assert table[2]["num_seeds"] == "0" and table[2]["num_failed"] == "2"
    assert float(table[0]["final_reward"]) == pytest.approx(0.5 + 0.15 + 0.045)
    md = (tmp_path / "summary.md").read_text()
    assert "group-seq-mean seed 1: exit code 1" in md and "train.log" in md
    for name in FIGURES:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert set(result.series[name]) == {"token-mean", "seq-mean-token-mean"}
    plotted = json.loads((tmp_path / "series.json").read_text())
    assert plotted["reward"]["modes"]["token-mean"]["per_seed"]["2"] == pytest.approx(
        [0.7 + 0.01 * i for i in range(6)]
    )

    # Run again: the finished runs are reused, only the failed ones are retried.
    calls.clear()
    again = compare_modes(overrides=["train.total_steps=6", "seed=1"], **kwargs)
    assert calls == [("group-seq-mean", 1), ("group-seq-mean", 2)]
    assert {r.status for r in again.runs if r.mode != "group-seq-mean"} == {"reused"}


def test_cli_compare_modes_exits_1_when_a_run_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare_runs, "_run_logged", fake_trainer("seq-mean-token-mean", []))
    args = ["compare-modes", "--modes", "token-mean,seq-mean-token-mean", "--out", str(tmp_path)]
    assert main([*args, "--set", "train.total_steps=6", "--last-k", "2"]) == 1
    out = capsys.readouterr().out
    assert "| token-mean | 1 |" in out and "summary.csv" in out
    assert main(["compare-modes", "--modes", "token-mean,bogus", "--out", str(tmp_path)]) == 2


def test_named_variants_are_compared_with_their_own_overrides(tmp_path, monkeypatch):
    seen: list = []

    def run(cmd, log, timeout):
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        seen.append(sets)
        out = Path(sets[-1].split("=", 1)[1])
        write_metrics(out, rows_of([0.2 + 0.1 * len(seen)] * 6, [10] * 6))
        return ""

    monkeypatch.setattr(compare_runs, "_run_logged", run)
    variants = {
        "sync": ["rollout.max_staleness=0"],
        "async": ["rollout.max_staleness=1", "reward.num_workers=1"],
    }
    result = compare_modes(
        config=None,
        modes=[],
        variants=variants,
        num_seeds=1,
        out=tmp_path,
        overrides=["train.total_steps=6"],
        k=2,
        window=2,
    )
    assert [s[1:-2] for s in seen] == [variants["sync"], variants["async"]]
    assert seen[1][-1] == f"output_dir={tmp_path / 'async' / 'seed_1234'}"
    assert [s.mode for s in result.summary] == ["sync", "async"]
