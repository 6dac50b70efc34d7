"""Per-step metrics: stdout, a jsonl file, TensorBoard, and wandb when configured.

Only the main rank writes. ``plot_run`` draws the reward and length curves of
a run directory's ``metrics.jsonl`` to PNG files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_grpo.config import MetricsConfig

STDOUT_KEYS = (
    "reward_mean",
    "response_length_mean",
    "loss",
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "logprob_mismatch",
    "tokens_per_s",
)


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
        self._bar = None
        if not enabled:
            return
        if total_steps is not None:  # a progress bar on stderr; metric lines go above it
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="GRPO steps", unit="step")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
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
        if self._bar is not None:
            self._bar.write(format_line(step, metrics))
            self._bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}")
            self._bar.update(1)
        else:
            print(format_line(step, metrics), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step:>4}"]
    for k in STDOUT_KEYS:
        v = metrics.get(k)
        if isinstance(v, int | float) and not math.isnan(v):
            parts.append(f"{k} {v:.4g}")
    return " | ".join(parts)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


PLOTS = {
    "reward.png": ("reward_mean", "reward (mean over samples)"),
    "response_length.png": ("response_length_mean", "response length (tokens)"),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Reward and length curves of a run to PNG; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (key, label) in PLOTS.items():
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*points), marker="o", markersize=3)
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
