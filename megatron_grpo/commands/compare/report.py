"""compare-modes' report: curves over seeds, the summary table and the figures.

From the runs' metrics it writes, under OUT, one figure per metric with one
curve per mode (mean over seeds, min-max band), ``series.json`` (the exact
numbers plotted) and a summary table (``summary.csv``, ``summary.md``): final
reward, length growth, steps to a reward threshold.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_grpo.commands.compare.runs import RunResult

FIGURES: dict[str, tuple[str, str]] = {
    "reward": ("rollout/reward_mean", "reward (mean over samples)"),
    "response_length": ("rollout/response_length_mean", "response length (tokens)"),
    "response_length_negative_advantage": (
        "rollout/response_length_neg_adv_mean",
        "length, worse than group (tokens)",
    ),
    "response_length_positive_advantage": (
        "rollout/response_length_pos_adv_mean",
        "length, better than group (tokens)",
    ),
    "truncated_fraction": ("rollout/truncated_fraction", "fraction of truncated responses"),
    "grad_norm": ("train/grad_norm", "global gradient norm"),
    "kl": ("train/kl", "KL to the reference model"),
}
"""Figure file stem -> (metrics.jsonl key, axis label)."""

REWARD, LENGTH = "rollout/reward_mean", "rollout/response_length_mean"
TRUNCATED, NEG_LENGTH = "rollout/truncated_fraction", "rollout/response_length_neg_adv_mean"
LINE_STYLES: tuple[Any, ...] = ("-", "--", "-.", ":", (0, (3, 1, 1, 1, 1, 1)))


# --------------------------------------------------------------------------- maths


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over full windows: entry i averages values[i : i + window]."""
    return [mean(values[i : i + window]) for i in range(len(values) - window + 1)]


def steps_to_threshold(
    steps: Sequence[int], values: Sequence[float], threshold: float, window: int
) -> int | None:
    """First step whose trailing ``window``-step moving average reaches ``threshold``."""
    for i, avg in enumerate(moving_average(values, window)):
        if avg >= threshold:
            return steps[i + window - 1]
    return None


def final_mean(values: Sequence[float], k: int) -> float:
    """Mean of the last ``k`` values (all of them if there are fewer)."""
    return mean(values[-k:])


def length_growth(lengths: Sequence[float], k: int) -> float:
    """Mean length of the last ``k`` steps over that of the first ``k``."""
    first = mean(lengths[:k])
    return mean(lengths[-k:]) / first if first else math.nan


@dataclass
class Series:
    """One curve of a figure: a metric of one mode, over the seeds that finished."""

    steps: list[int]
    mean: list[float]
    low: list[float]
    """Minimum over seeds at each step."""
    high: list[float]
    """Maximum over seeds at each step."""
    std: list[float]
    """Population standard deviation over seeds at each step."""
    per_seed: dict[int, list[float]]


def aggregate(per_seed_rows: dict[int, list[dict[str, Any]]], key: str) -> Series | None:
    """Mean and spread of ``key`` over seeds, on the steps every seed logged it at."""
    by_seed = {
        seed: {r["step"]: float(r[key]) for r in rows if r.get(key) is not None}
        for seed, rows in per_seed_rows.items()
    }
    if not by_seed:
        return None
    steps = sorted(set.intersection(*(set(v) for v in by_seed.values())))
    if not steps:
        return None
    columns = [[by_seed[seed][s] for seed in by_seed] for s in steps]
    means = [mean(c) for c in columns]
    return Series(
        steps=steps,
        mean=means,
        low=[min(c) for c in columns],
        high=[max(c) for c in columns],
        std=[math.sqrt(mean([(x - m) ** 2 for x in c])) for c, m in zip(columns, means)],
        per_seed={seed: [by_seed[seed][s] for s in steps] for seed in by_seed},
    )


# --------------------------------------------------------------------------- summary


@dataclass
class ModeSummary:
    mode: str
    num_seeds: int
    """Seeds that finished."""
    num_failed: int
    final_reward: float
    """Mean over seeds of the mean reward of the last k steps."""
    final_reward_std: float
    length_first: float
    """Mean over seeds of the mean length of the first k steps."""
    length_last: float
    length_growth: float
    """Mean over seeds of (mean length of the last k steps / of the first k)."""
    length_growth_std: float
    neg_length_first: float
    """As length_first, for the responses worse than their group (negative advantage)."""
    neg_length_last: float
    truncated_last: float
    """Mean over seeds of the truncated fraction of the last k steps."""
    steps_to_threshold: int | None
    """On the mean-over-seeds reward curve; None: not reached."""
    steps_to_threshold_per_seed: list[int | None]


def _std(values: Sequence[float]) -> float:
    m = mean(values)
    return math.sqrt(mean([(v - m) ** 2 for v in values])) if values else math.nan


def summarize(
    mode: str, runs: Sequence[RunResult], *, k: int, threshold: float, window: int
) -> ModeSummary:
    """The table row of one mode, from its runs (failed ones are only counted)."""
    done = [r for r in runs if r.ok]
    rewards = [[row[REWARD] for row in r.rows] for r in done]
    lengths = [[row[LENGTH] for row in r.rows] for r in done]
    truncated = [[row.get(TRUNCATED, math.nan) for row in r.rows] for r in done]
    neg_lengths = [[row[NEG_LENGTH] for row in r.rows if NEG_LENGTH in row] for r in done]
    steps = [[row["step"] for row in r.rows] for r in done]
    reward_curve = aggregate({r.seed: r.rows for r in done}, REWARD)
    finals = [final_mean(x, k) for x in rewards]
    growths = [length_growth(x, k) for x in lengths]
    return ModeSummary(
        mode=mode,
        num_seeds=len(done),
        num_failed=len(runs) - len(done),
        final_reward=mean(finals),
        final_reward_std=_std(finals),
        length_first=mean([mean(x[:k]) for x in lengths]),
        length_last=mean([final_mean(x, k) for x in lengths]),
        length_growth=mean(growths),
        length_growth_std=_std(growths),
        neg_length_first=mean([mean(x[:k]) for x in neg_lengths]),
        neg_length_last=mean([final_mean(x, k) for x in neg_lengths]),
        truncated_last=mean([final_mean(x, k) for x in truncated]),
        steps_to_threshold=None
        if reward_curve is None
        else steps_to_threshold(reward_curve.steps, reward_curve.mean, threshold, window),
        steps_to_threshold_per_seed=[
            steps_to_threshold(s, x, threshold, window) for s, x in zip(steps, rewards)
        ],
    )


def _step_text(step: int | None) -> str:
    return "not reached" if step is None else str(step)


def _num(x: float, digits: int = 3) -> str:
    return "" if math.isnan(x) else f"{x:.{digits}f}"


CSV_COLUMNS = (
    "mode",
    "num_seeds",
    "num_failed",
    "final_reward",
    "final_reward_std",
    "length_first",
    "length_last",
    "length_growth",
    "length_growth_std",
    "neg_adv_length_first",
    "neg_adv_length_last",
    "truncated_last",
    "steps_to_threshold",
    "steps_to_threshold_per_seed",
)


def write_csv(rows: Sequence[ModeSummary], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for s in rows:
            writer.writerow(
                [
                    s.mode,
                    s.num_seeds,
                    s.num_failed,
                    _num(s.final_reward, 4),
                    _num(s.final_reward_std, 4),
                    _num(s.length_first, 3),
                    _num(s.length_last, 3),
                    _num(s.length_growth, 4),
                    _num(s.length_growth_std, 4),
                    _num(s.neg_length_first, 3),
                    _num(s.neg_length_last, 3),
                    _num(s.truncated_last, 4),
                    _step_text(s.steps_to_threshold),
                    ";".join(map(_step_text, s.steps_to_threshold_per_seed)),
                ]
            )


def markdown_table(
    rows: Sequence[ModeSummary],
    failed: Sequence[RunResult],
    *,
    k: int,
    threshold: float,
    window: int,
) -> str:
    def pm(x: float, sd: float, digits: int, num_seeds: int) -> str:
        return _num(x, digits) + (f" ± {_num(sd, digits)}" if num_seeds > 1 else "")

    lines = [
        f"| mode | seeds | final reward (last {k}) | length first {k} -> last {k} "
        f"| length growth | worse-than-group length first {k} -> last {k} "
        f"| truncated (last {k}) | steps to reward >= {threshold:g} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        seeds = f"{s.num_seeds}" + (f" ({s.num_failed} failed)" if s.num_failed else "")
        per_seed = ", ".join(map(_step_text, s.steps_to_threshold_per_seed))
        lines.append(
            f"| {s.mode} | {seeds} | {pm(s.final_reward, s.final_reward_std, 3, s.num_seeds)} "
            f"| {_num(s.length_first, 1)} -> {_num(s.length_last, 1)} "
            f"| {pm(s.length_growth, s.length_growth_std, 2, s.num_seeds)} "
            f"| {_num(s.neg_length_first, 1)} -> {_num(s.neg_length_last, 1)} "
            f"| {_num(s.truncated_last, 3)} | {_step_text(s.steps_to_threshold)}"
            + (f" (per seed: {per_seed})" if s.num_seeds > 1 else "")
            + " |"
        )
    lines += [
        "",
        f"Means over seeds (± population std). Steps to threshold: first step whose "
        f"{window}-step trailing mean of the seed-mean reward reaches {threshold:g}.",
    ]
    if failed:
        lines += ["", "Failed runs (left out of the figures and the numbers):", ""]
        lines += [f"- {r.mode} seed {r.seed}: {r.error}" for r in failed]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- figures


def plot_figures(series: dict[str, dict[str, Series]], out: Path, *, num_seeds: int) -> list[Path]:
    """One PNG per metric, one curve per mode (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, curves in series.items():
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for i, (mode, s) in enumerate(curves.items()):
            # Modes can coincide (group-seq-mean = seq-mean-token-mean with equal groups):
            # line styles keep every curve visible.
            style = LINE_STYLES[i % len(LINE_STYLES)]
            (line,) = ax.plot(s.steps, s.mean, linestyle=style, label=mode, linewidth=1.5)
            if len(s.per_seed) > 1:
                ax.fill_between(s.steps, s.low, s.high, color=line.get_color(), alpha=0.15)
        ax.set_xlabel("step")
        ax.set_ylabel(FIGURES[name][1])
        spread = ", band: min-max over seeds" if num_seeds > 1 else ""
        ax.set_title(f"mean over {num_seeds} seed{'s' * (num_seeds > 1)}{spread}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


# --------------------------------------------------------------------------- the report


@dataclass
class Comparison:
    runs: list[RunResult]
    series: dict[str, dict[str, Series]]
    """Figure name -> mode -> the curve plotted."""
    summary: list[ModeSummary]
    markdown: str
    """The summary table as written to summary.md."""
    files: list[Path]

    @property
    def failed(self) -> list[RunResult]:
        return [r for r in self.runs if not r.ok]


def collect_series(runs: Sequence[RunResult], modes: Sequence[str]) -> dict[str, dict[str, Series]]:
    series: dict[str, dict[str, Series]] = {}
    for name, (key, _) in FIGURES.items():
        series[name] = {}
        for mode in modes:
            s = aggregate({r.seed: r.rows for r in runs if r.mode == mode and r.ok}, key)
            if s is not None:
                series[name][mode] = s
    return series


def report(
    runs: list[RunResult],
    modes: Sequence[str],
    out: Path,
    *,
    k: int,
    threshold: float,
    window: int,
) -> Comparison:
    """Figures, series.json and the summary table of finished runs, written under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    series = collect_series(runs, modes)
    num_seeds = len({r.seed for r in runs})
    files = plot_figures(series, out, num_seeds=num_seeds)
    plotted = {
        name: {"key": FIGURES[name][0], "modes": {m: vars(s) for m, s in curves.items()}}
        for name, curves in series.items()
    }
    (out / "series.json").write_text(json.dumps(plotted, indent=1))
    rows = [
        summarize(m, [r for r in runs if r.mode == m], k=k, threshold=threshold, window=window)
        for m in modes
    ]
    write_csv(rows, out / "summary.csv")
    failed = [r for r in runs if not r.ok]
    md = markdown_table(rows, failed, k=k, threshold=threshold, window=window)
    (out / "summary.md").write_text(md)
    files += [out / "series.json", out / "summary.csv", out / "summary.md"]
    return Comparison(runs, series, rows, md, files)
