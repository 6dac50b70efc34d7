"""The CPU demo against TRL's GRPOTrainer: seconds per step, its split, memory, start-up.

    python bench/vs_trl.py                 # 4 interleaved repeats of 15 steps each
    python bench/vs_trl.py --quick         # 1 repeat of 4 steps (smoke test)

Needs ``trl`` (an optional bench dependency: ``pip install -e '.[bench]'``), and the demo's
assets (``python examples/cpu_demo/prepare.py --out runs/cpu_demo/assets``).
Three contenders, each a fresh process tree started from here, run one after the
other in every repeat, in an order that rotates from repeat to repeat:

- ``trl``: ``bench/_trl_grpo.py``, TRL's GRPOTrainer (transformers generate, one
  process, fp32);
- ``pp1``: ``megatron-grpo train`` on ``examples/cpu_demo/grpo.yaml`` at one process;
- ``pp2``: the same at the demo's layout, ``--nproc 2`` with PP=2.

Both sides do the same work per step: 32 prompts x 8 samples of at most 4 tokens,
scored by the same math reward, one optimizer step on all 256 samples. So dynamic
sampling (on in the demo, which then generates more rounds to refill dropped
groups; TRL has none) is switched off here, as are the demo's checkpoints (TRL
saves none).

Every process of both sides runs with the same number of torch threads (``--threads``,
default 1 as torchrun gives its workers): on a shared machine, threads that wait for
each other's cores swing wall times by several times.

Per contender and repeat: the median seconds per step over steps 2..N (the time
between the ends of consecutive steps, as seen from here: the metrics line of a
step, or TRL's step-end callback), the median split of a step into rollout
(generation and scoring), train and weight sync, the peak resident memory of every
process of its tree (``VmHWM``, sampled every 50 ms) and the start-up time (from
starting the process to the beginning of step 1). Reported: per repeat the ratio of
our median s/step to TRL's of the same repeat, summarized over repeats; and each
side's mean reward per step (the JSON result, and with ``--plot`` a figure of its
median over the repeats). Repeat r runs every side with seed r (ours: ``seed``; TRL:
``GRPOConfig.seed``), so the repeats are different seeds, the same on both sides.

``--set KEY=VALUE`` (repeatable) changes our sides' config, e.g.
``--set reward.cache_size=0`` to score every answer again as TRL does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import BENCH_DIR, Ratio, parser, summary, write_result

REPO = BENCH_DIR.parent
DEMO_CONFIG = REPO / "examples" / "cpu_demo" / "grpo.yaml"
_POLL_S = 0.01
_MEMORY_EVERY = 5  # polls


def parse_args():
    p = parser(__doc__)
    p.add_argument("--assets", default="runs/cpu_demo/assets", help="the demo's assets")
    p.add_argument("--steps", type=int, help="steps per run (default 15; 4 with --quick)")
    p.add_argument("--repeats", type=int, help="interleaved repeats (default 4; 1 with --quick)")
    p.add_argument(
        "--sides", default="trl,pp1,pp2", help="comma-separated contenders: trl, pp1, pp2"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for our sides (repeatable)",
    )
    p.add_argument("--plot", help="write the reward curves of every side to this PNG")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every process of both sides (OMP_NUM_THREADS; default 1, as "
        "torchrun gives its workers)",
    )
    return p.parse_args()


@dataclass
class Run:
    """What one contender's run measured."""

    step_s: float
    """Median seconds per step over steps 2..N."""
    step_cpu_s: float
    """Median CPU seconds per step over steps 2..N, all processes of the tree together."""
    split_s: dict[str, float]
    """Median seconds of each phase of a step (rollout, train, sync)."""
    startup_s: float
    """From starting the process to the beginning of step 1."""
    peak_mb: dict[str, float] = field(default_factory=dict)
    """Peak resident memory of each process of the tree, MB, by pid and command."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward of each step."""

    @property
    def total_peak_mb(self) -> float:
        return sum(self.peak_mb.values())


def our_command(
    assets: Path, out: Path, steps: int, nproc: int, seed: int, extra: list[str]
) -> list[str]:
    sets = {
        "seed": seed,
        "output_dir": out,
        "tokenizer": assets / "model",
        "data.path": assets / "train.jsonl",
        "train.init": assets / "model",
        "train.total_steps": steps,
        "train.save_interval": 0,
        "parallel.pp": nproc,
        "advantages.dynamic_sampling": "false",
        "metrics.tensorboard": "false",
    }
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(DEMO_CONFIG)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    for setting in extra:
        cmd += ["--set", setting]
    return cmd + (["--nproc", str(nproc)] if nproc > 1 else [])


def trl_command(assets: Path, events: Path, steps: int, seed: int) -> list[str]:
    script = BENCH_DIR / "_trl_grpo.py"
    return [sys.executable, str(script), "--assets", str(assets), "--events", str(events)] + [
        "--steps",
        str(steps),
        "--seed",
        str(seed),
    ]


def run_side(side: str, assets: Path, steps: int, seed: int, args) -> Run:
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{side}_") as tmp:
        work = Path(tmp)
        if side == "trl":
            events = work / "events.jsonl"
            cmd = trl_command(assets, events, steps, seed)
        else:
            events = work / "run" / "metrics.jsonl"
            cmd = our_command(
                assets, work / "run", steps, nproc=int(side[2:]), seed=seed, extra=args.sets
            )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), *_pythonpath()]),
            "OMP_NUM_THREADS": str(args.threads),
        }
        start = time.time()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=open(work / "log", "wb"), stderr=subprocess.STDOUT
        )
        watch = _Watch(proc.pid, events)
        try:
            while proc.poll() is None:
                if time.time() - start > args.timeout:
                    raise RuntimeError(f"{side}: no end within {args.timeout} s")
                watch.poll()
                time.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        watch.poll()
        if proc.returncode != 0:
            tail = (work / "log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{side} failed ({proc.returncode}):\n{tail}")
        rows = watch.rows
        if len(rows) < steps:
            raise RuntimeError(f"{side}: {len(rows)} of {steps} steps seen")
        return _summarize(side, rows, start, watch.peaks)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


class _Watch:
    """Follows a run's per-step lines (stamped with their arrival time) and the peak
    memory of every process of its tree."""

    def __init__(self, pid: int, events: Path) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.events = events
        self.rows: list[dict[str, Any]] = []
        self.peaks: dict[str, float] = {}
        self._by_pid: dict[int, str] = {}
        self._offset = 0
        self._polls = 0

    def poll(self) -> None:
        if self.events.exists():
            with self.events.open() as f:
                f.seek(self._offset)
                text = f.read()
            done, _, _ = text.rpartition("\n")
            if done:
                now, cpu = time.time(), self._cpu_s()
                self._offset += len(done) + 1
                for line in done.splitlines():
                    self.rows.append({**json.loads(line), "seen": now, "cpu": cpu})
        self._polls += 1
        if self._polls % _MEMORY_EVERY == 1:
            self._memory()

    def _cpu_s(self) -> float:
        """CPU seconds (user and system) of every live process of the tree."""
        import psutil

        total = 0.0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return total
        for p in procs:
            try:
                times = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += times.user + times.system
        return total

    def _memory(self) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                peak, command = _peak_rss_mb(p), _short(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            # one entry per process: a forked child that then runs another program
            # (torchrun's workers) keeps its pid, and takes the later command's name
            old = self._by_pid.pop(p.pid, None)
            if old is not None:
                peak = max(peak, self.peaks.pop(old))
            key = f"{p.pid} {command}"
            self._by_pid[p.pid] = key
            self.peaks[key] = peak


def _peak_rss_mb(p) -> float:
    """The process's peak resident set (VmHWM), or its current one where there is none."""
    try:
        for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return p.memory_info().rss / 2**20


def _short(cmdline: list[str]) -> str:
    """The interesting part of a command line: the module or script and the subcommand."""
    words = [Path(w).name if w.startswith("/") else w for w in cmdline[1:4]]
    return " ".join(words)


def _summarize(side: str, rows: list[dict[str, Any]], start: float, peaks) -> Run:
    reward_key = "reward" if side == "trl" else "rollout/reward_mean"
    if side == "trl":
        ends = [r["end"] for r in rows]
        split = {k: [r[f"{k}_s"] for r in rows[1:]] for k in ("rollout", "train")}
        first_begin = rows[0]["begin"]
    else:
        ends = [r["seen"] for r in rows]
        split = {k: [r[f"perf/time_{k}_s"] for r in rows[1:]] for k in ("rollout", "train", "sync")}
        first = rows[0]
        first_begin = first["seen"] - sum(
            first[f"perf/time_{k}_s"] for k in ("rollout", "train", "sync")
        )
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [r["cpu"] for r in rows]
    return Run(
        step_s=summary(gaps)["median"],
        step_cpu_s=summary([b - a for a, b in zip(cpu, cpu[1:])])["median"],
        split_s={k: summary(v)["median"] for k, v in split.items()},
        startup_s=first_begin - start,
        peak_mb=dict(peaks),
        rewards=[float(r[reward_key]) for r in rows],
    )


def report(runs: dict[str, list[Run]], args, steps: int) -> None:
    ratios: dict[str, Ratio] = {}
    for side in (s for s in runs if s != "trl" and "trl" in runs):
        target = 1.0 if side == "pp1" else 1.3
        for clock, attr in (("wall", "step_s"), ("cpu", "step_cpu_s")):
            ratio = Ratio.of(
                f"{side}_s_per_step/trl_s_per_step [{clock}]",
                [getattr(o, attr) / getattr(t, attr) for o, t in zip(runs[side], runs["trl"])],
            )
            ratios[f"{side}_{clock}"] = ratio
            print(ratio.line(target))
        ratios[f"{side}_memory"] = Ratio.of(
            f"{side}_peak_memory_sum/trl_peak_memory_sum",
            [o.total_peak_mb / t.total_peak_mb for o, t in zip(runs[side], runs["trl"])],
        )
        print(ratios[f"{side}_memory"].line(2.0 if side == "pp1" else None))
    table = {}
    for side, side_runs in runs.items():
        table[side] = {
            "s_per_step": summary([r.step_s for r in side_runs]),
            "cpu_s_per_step": summary([r.step_cpu_s for r in side_runs]),
            "split_s": {
                k: summary([r.split_s[k] for r in side_runs]) for k in side_runs[0].split_s
            },
            "startup_s": summary([r.startup_s for r in side_runs]),
            "peak_memory_sum_mb": summary([r.total_peak_mb for r in side_runs]),
            "peak_memory_mb_last_run": side_runs[-1].peak_mb,
            "reward_by_step": [r.rewards for r in side_runs],
        }
        row = table[side]
        split = ", ".join(f"{k} {v['median']:.3f}" for k, v in row["split_s"].items())
        print(
            f"  {side}: {row['s_per_step']['median']:.3f} s/step ({split}), cpu "
            f"{row['cpu_s_per_step']['median']:.3f} s/step; start-up "
            f"{row['startup_s']['median']:.1f} s; peak memory, all processes "
            f"{row['peak_memory_sum_mb']['median']:.0f} MB"
        )
        for proc, mb in side_runs[-1].peak_mb.items():
            print(f"    {mb:7.0f} MB  {proc}")
    write_result(
        "vs_trl",
        args.out,
        {
            "quick": args.quick,
            "settings": {
                "steps": steps,
                "repeats": len(next(iter(runs.values()))),
                "threads": args.threads,
                "our_sets": args.sets,
            },
            "ratios": ratios,
            "sides": table,
        },
    )


def main() -> None:
    args = parse_args()
    steps = args.steps or (4 if args.quick else 15)
    repeats = args.repeats or (1 if args.quick else 4)
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - {"trl", "pp1", "pp2"}
    if unknown:
        raise SystemExit(f"unknown sides {sorted(unknown)}")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -e '.[bench]'") from None
    assets = Path(args.assets).resolve()
    if not (assets / "model" / "config.json").exists():
        raise SystemExit(f"no demo assets in {assets}: run examples/cpu_demo/prepare.py")
    runs: dict[str, list[Run]] = {s: [] for s in sides}
    for rep in range(repeats):
        shift = rep % len(sides)
        for side in sides[shift:] + sides[:shift]:
            run = run_side(side, assets, steps, seed=rep + 1, args=args)
            print(
                f"repeat {rep + 1} {side}: {run.step_s:.3f} s/step (cpu {run.step_cpu_s:.3f}), "
                f"start-up {run.startup_s:.1f} s, memory {run.total_peak_mb:.0f} MB",
                flush=True,
            )
            runs[side].append(run)
    report(runs, args, steps)
    if args.plot:
        plot_rewards(runs, Path(args.plot))


def plot_rewards(runs: dict[str, list[Run]], path: Path) -> None:
    """Each side's median reward per step over its repeats, with their range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = {"trl": "TRL GRPOTrainer", "pp1": "ours, 1 process", "pp2": "ours, PP2"}
    styles = {"trl": "-", "pp1": "-", "pp2": "--"}  # PP2's curve is PP1's: both visible
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for side, side_runs in runs.items():
        steps = min(len(r.rewards) for r in side_runs)
        values = np.array([r.rewards[:steps] for r in side_runs])
        x = np.arange(1, steps + 1)
        ax.plot(
            x,
            np.median(values, axis=0),
            styles[side],
            label=f"{labels[side]}, median of {len(side_runs)} seeds",
        )
        ax.fill_between(x, values.min(axis=0), values.max(axis=0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
