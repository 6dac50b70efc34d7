"""Compare loss modes: the same training once per mode and seed, then figures and a table.

``compare_modes`` runs ``megatron-grpo train`` in a subprocess for every
(mode, seed), one after the other, into ``OUT/<mode>/seed_<S>`` (``runs.py``).
Runs differ only in ``loss.mode`` and ``seed`` (or, for named ``variants``, in their own
overrides and ``seed``): the data order (``data.seed``) and the rollout seeds of a given
seed are the same for every mode. It then
writes the figures, ``series.json`` and the summary table under OUT
(``report.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_grpo.commands.compare.report import Comparison, report
from megatron_grpo.commands.compare.runs import run_one
from megatron_grpo.config import load_config

__all__ = ["Comparison", "compare_modes"]


def compare_modes(
    *,
    config: str | None,
    modes: Sequence[str],
    num_seeds: int,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    nproc: int = 1,
    threshold: float = 0.5,
    window: int = 5,
    k: int = 5,
    timeout: float | None = None,
    variants: Mapping[str, Sequence[str]] | None = None,
) -> Comparison:
    """Train every (mode, seed) in turn (reusing finished runs), then write the report.

    ``variants`` (name -> overrides) replace the loss modes: each is a curve of its own."""
    arms = {m: [f"loss.mode={m}"] for m in modes} if not variants else dict(variants)
    modes = list(arms)
    if num_seeds < 1 or window < 1 or k < 1 or nproc < 1:
        raise ValueError(
            f"--seeds, --window, --last-k and --nproc must be >= 1, "
            f"got {num_seeds}, {window}, {k}, {nproc}"
        )
    if not modes:
        raise ValueError("--modes names no mode")
    base = load_config(config, list(overrides))
    out = Path(out or base.output_dir)
    seeds = [base.seed + i for i in range(num_seeds)]
    for arm in arms.values():  # every mode's config is valid before the first run starts
        load_config(config, [*overrides, *arm])
    runs = []
    jobs = [(mode, seed) for seed in seeds for mode in modes]
    for i, (mode, seed) in enumerate(jobs, 1):
        start = time.perf_counter()
        result = run_one(
            config=config,
            overrides=overrides,
            mode=mode,
            arm=arms[mode],
            seed=seed,
            out=out,
            total_steps=base.train.total_steps,
            nproc=nproc,
            timeout=timeout,
        )
        what = result.error if not result.ok else result.status
        print(
            f"[{i}/{len(jobs)}] {mode} seed {seed}: {what} "
            f"({time.perf_counter() - start:.0f} s, {result.run_dir})",
            flush=True,
        )
        runs.append(result)
    return report(runs, modes, out, k=k, threshold=threshold, window=window)
