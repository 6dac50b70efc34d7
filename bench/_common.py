"""What every benchmark shares: command-line basics, ratio statistics, the JSON result.

Every benchmark reports a RATIO of two things measured side by side in one
run (interleaved, repeated), never an absolute time: the machines these run
on are shared and noisy, and a ratio of neighbours survives that far better.
``Ratio`` summarizes the per-repeat ratios (median, quartiles, extremes).

Scripts are run as ``python bench/<name>.py``, which puts this directory on
``sys.path``; the multi-process ones hand it to their workers through
``PYTHONPATH`` (``worker_env``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


@dataclass(frozen=True)
class Ratio:
    """Summary of per-repeat ratios ``numerator / denominator``."""

    name: str
    median: float
    q1: float
    q3: float
    min: float
    max: float
    repeats: int

    @classmethod
    def of(cls, name: str, values: Sequence[float]) -> Ratio:
        if not values:
            raise ValueError(f"ratio {name}: no repeats")
        ordered = sorted(values)
        q1, q3 = _quartiles(ordered)
        return cls(
            name=name,
            median=statistics.median(ordered),
            q1=q1,
            q3=q3,
            min=ordered[0],
            max=ordered[-1],
            repeats=len(ordered),
        )

    def line(self, target: float | None = None, *, at_most: bool = True) -> str:
        text = (
            f"RATIO {self.name}: median {self.median:.3f} "
            f"(IQR {self.q1:.3f}-{self.q3:.3f}, min {self.min:.3f}, max {self.max:.3f}; "
            f"{self.repeats} repeats)"
        )
        if target is not None:
            met = self.median <= target if at_most else self.median >= target
            sign = "<=" if at_most else ">="
            text += f"; target {sign} {target:g}: {'met' if met else 'NOT met'}"
        return text


def _quartiles(ordered: Sequence[float]) -> tuple[float, float]:
    if len(ordered) < 2:
        return ordered[0], ordered[0]
    q = statistics.quantiles(ordered, n=4, method="inclusive")
    return q[0], q[2]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of plain measurements (seconds, bytes, ...)."""
    r = Ratio.of("values", values)
    return {"median": r.median, "q1": r.q1, "q3": r.q3, "min": r.min, "max": r.max}


def parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (smoke test)")
    p.add_argument("--out", help="JSON result path (default: bench/results/<name>.json)")
    return p


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_result(name: str, out: str | None, result: dict[str, Any]) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": name, "machine": machine(), **result}
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Ratio):
        return asdict(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def worker_env() -> dict[str, str]:
    """Environment for ``run_workers`` so that workers can import this directory's modules."""
    paths = [str(BENCH_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(paths)}


@dataclass(frozen=True)
class Timing:
    """One timed run: wall-clock seconds, and CPU seconds of this whole process."""

    wall: float
    cpu: float

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.wall + other.wall, self.cpu + other.cpu)


def measure(fn: Callable[[], Any]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def interleaved(
    actions: dict[str, Callable[[], Any]], *, repeats: int, warmup: int
) -> dict[str, list[Timing]]:
    """Run every action once per repeat, rotating their order; the timings after warm-up.

    Rotating the order keeps a slow first or last slot of a repeat from
    landing on the same action every time. Both clocks are kept: on a shared
    machine other jobs inflate wall time at random, while a process's CPU
    time counts only its own work (all its threads: gloo's, a server's).
    """
    names = list(actions)
    times: dict[str, list[Timing]] = {n: [] for n in names}
    for rep in range(warmup + repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            timing = measure(actions[name])
            if rep >= warmup:
                times[name].append(timing)
    return times


def sum_over_ranks(times: dict[str, list[Timing]]) -> dict[str, list[Timing]] | None:
    """On global rank 0: per repeat, CPU time summed over the ranks, wall time of the first.

    Collective. A rank may time only some of the actions (a pipeline stage
    without the loss, say); the others' timings of an action are added up.
    None on ranks other than 0.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if dist.get_rank() != 0:
        return None
    out: dict[str, list[Timing]] = {}
    for rank in everyone:
        for name, runs in rank.items():
            if name not in out:
                out[name] = list(runs)
            else:
                out[name] = [Timing(a.wall, a.cpu + b.cpu) for a, b in zip(out[name], runs)]
    return out


def ratios(times: dict[str, list[Timing]], num: Sequence[str], den: str, clock: str) -> list[float]:
    """Per repeat: sum of the ``num`` actions' times / the ``den`` action's, on one clock."""
    return [
        sum(getattr(times[n][i], clock) for n in num) / getattr(times[den][i], clock)
        for i in range(len(times[den]))
    ]


def seconds(times: dict[str, list[Timing]]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        name: {clock: summary([getattr(t, clock) for t in runs]) for clock in ("wall", "cpu")}
        for name, runs in times.items()
    }


def tiny_model(**fields: Any):
    """A 2-layer, 64-wide Qwen-style ``ModelConfig`` for quick runs; ``fields`` set the rest."""
    from megatron_grpo.config import ModelConfig

    shape = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2
    )
    return ModelConfig(**{**shape, **fields})


def run_at_layout(
    script: str, layout, *, timeout: float, env: dict[str, str] | None = None, **kwargs: Any
) -> list:
    """``worker(tp=..., pp=..., **kwargs)`` of the bench script ``script`` on every rank of
    ``layout`` (a DPxTPxPP ``Layout``), with ``env`` added to the workers' environment; each
    rank's result."""
    from megatron_grpo.launch import run_workers

    return run_workers(
        f"{Path(script).resolve()}:worker",
        layout.world_size,
        kwargs={"tp": layout.tp, "pp": layout.pp, **kwargs},
        timeout=timeout,
        env={**worker_env(), **(env or {})},
    )
