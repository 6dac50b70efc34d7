"""Per-step metrics: stdout, a jsonl file, TensorBoard, and wandb when configured.

Only the main rank writes. On a terminal a progress bar over the steps sits
below the step lines; when the output goes to a file or a pipe there is no
bar, and each step's line carries the step count and the elapsed and
remaining time instead. ``plot_run`` draws the reward and length curves of a
run directory's ``metrics.jsonl`` to PNG files, the held-out sets' pass@k
(``eval/<set>/pass@<k>``) beside the training reward.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_grpo.config import MetricsConfig

logger = logging.getLogger(__name__)

NAMESPACES = ("rollout", "train", "perf", "eval")
"""Metric names are grouped by concern: ``rollout/`` (generations, rewards, sampling),
``train/`` (loss terms, gradient, learning rate), ``perf/`` (time and throughput),
``eval/`` (held-out sets)."""

STDOUT_KEYS = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/clip_fraction",
    "train/grad_norm",
    "train/logprob_mismatch",
    "perf/train_tokens_per_s",
)
"""Shown on each step's line, by the name after the namespace (and each held-out set's
``eval/<set>/pass@1`` when the step has one)."""


def over_optimizer_steps(history: list[dict[str, float | None]]) -> dict[str, float | None]:
    """The ``train/`` metrics of one RL step from its optimizer steps' (one per mini-batch
    and iteration): each the mean over the steps that have it (None where none has), the
    last step's beside them as ``last_step/<name>``, and ``optimizer_steps``, how many."""
    means: dict[str, float | None] = {}
    for key in history[0]:
        values = [v for step in history if (v := step.get(key)) is not None]
        means[key] = sum(values) / len(values) if values else None
    last = {f"last_step/{key}": value for key, value in history[-1].items()}
    return {**means, **last, "optimizer_steps": float(len(history))}


def namespaced(namespace: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with every name under ``namespace/`` (one of ``NAMESPACES``)."""
    assert namespace in NAMESPACES, namespace
    return {f"{namespace}/{k}": v for k, v in metrics.items()}


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        cfg: MetricsConfig,
        *,
        enabled: bool,
        run_config: dict,
        total_steps: int | None = None,
        start_step: int = 0,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        self._progress: _Progress | None = None
        if not enabled:
            return
        if total_steps is not None:
            self._progress = _Progress(total_steps, start_step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A run from step 0 starts afresh: its step-0 row (the initial evaluation) comes again.
        first_new_step = start_step + 1 if start_step else 0
        truncate_metrics(self.path, first_new_step - 1)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard drops the events of the steps that are run again now.
            self._tb = SummaryWriter(
                str(Path(output_dir) / "tensorboard"), purge_step=first_new_step
            )
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError(
                    "metrics.wandb_project is set but wandb is not installed: pip install wandb"
                ) from None
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name or Path(output_dir).name,
                config=run_config,
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._progress is not None:
            self._progress.show(step, metrics)
        else:
            print(format_line(step, metrics), flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class _Progress:
    """The step lines of a run of known length, with a progress bar when on a terminal.

    The bar (on stderr) is cleared and redrawn around each step line (on
    stdout), which reads well only when both streams reach the terminal
    directly: redirected, the bar's carriage returns end up between the lines,
    and through a pipe (``| tee``) the lines arrive after the bar is redrawn.
    """

    def __init__(self, total_steps: int, start_step: int) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.start_time = time.monotonic()
        self._bar = None
        if sys.stdout.isatty() and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="GRPO steps",
                unit="step",
                file=sys.stderr,
            )

    def show(self, step: int, metrics: dict[str, Any]) -> None:
        if step <= self.start_step:  # the evaluation before the first step: no step done
            line = format_line(step, metrics, total_steps=self.total_steps)
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)
            return
        if self._bar is not None:
            self._bar.write(format_line(step, metrics))
            self._bar.update(1)
            return
        elapsed = time.monotonic() - self.start_time
        line = format_line(step, metrics, total_steps=self.total_steps)
        times = _times(elapsed, step - self.start_step, self.total_steps - step)
        print(f"{line} | {times}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _times(elapsed_s: float, steps_done: int, steps_left: int) -> str:
    """Elapsed and remaining time as the bar shows them (remaining at this run's pace)."""
    from tqdm import tqdm

    remaining = elapsed_s / steps_done * steps_left
    return (
        f"elapsed {tqdm.format_interval(elapsed_s)} | remaining {tqdm.format_interval(remaining)}"
    )


def format_line(step: int, metrics: dict[str, Any], *, total_steps: int | None = None) -> str:
    """``step    3 | reward_mean 0.5 | ...``; with ``total_steps``, ``step    3/40 | ...``."""
    parts = [f"step {step:>4}" + (f"/{total_steps}" if total_steps is not None else "")]
    held_out = sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/pass@1"))
    for k in (*STDOUT_KEYS, *held_out):
        v = metrics.get(k)
        if isinstance(v, int | float) and not math.isnan(v):
            parts.append(f"{k.partition('/')[2]} {v:.4g}")
    return " | ".join(parts)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the rows of ``path`` up to ``last_step``: a resumed run logs the steps after its
    checkpoint again. Rows that do not parse (a line cut short by a kill) are dropped with
    a warning naming them."""
    if not path.exists():
        return
    kept, dropped = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["step"]
        except (ValueError, KeyError, TypeError):
            dropped.append(number)
            continue
        if step <= last_step:
            kept.append(line)
    if dropped:
        logger.warning("%s: dropping unreadable line(s) %s", path, ", ".join(map(str, dropped)))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not a JSON row ({e})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{path}:{number}: not a metrics row (an object with a step)")
        rows.append(row)
    return rows


PLOTS = {
    "reward.png": ("rollout/reward_mean", "reward (mean over samples)"),
    "response_length.png": ("rollout/response_length_mean", "response length (tokens)"),
}
"""One figure per training metric; held-out pass@k curves join the reward's."""


def curves(rows: list[dict[str, Any]], key: str) -> dict[str, list[tuple[int, float]]]:
    """The ``(step, value)`` series drawn in ``key``'s figure, by legend label: the key
    itself, and for the reward every ``eval/<set>/pass@<k>`` of the run."""
    keys = [key]
    if key == PLOTS["reward.png"][0]:
        keys += sorted({k for r in rows for k in r if k.startswith("eval/") and "/pass@" in k})
    out = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
    return {k: points for k, points in out.items() if points}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Reward (with held-out pass@k) and length curves of a run to PNG; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (key, label) in PLOTS.items():
        series = curves(rows, key)
        if key not in series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, points in series.items():
            ax.plot(*zip(*points), marker="o", markersize=3, label=name)
        if len(series) > 1:
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
        written.append(out / filename)
    if not written:
        raise ValueError(f"{run_dir}: no reward or length metrics to plot")
    return written
