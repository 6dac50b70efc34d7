"""Padding of the micro-batch planner (packed and unpacked) vs naive fixed-size micro-batches.

    python bench/packing.py                 # 1024 samples, DP 8, 16k budget, 10 draws each
    python bench/packing.py --quick

Sample lengths (prompt + completion) are drawn from long-tailed distributions
with completions up to 16k tokens (lognormal, and Pareto where many hit the
length cap, as truncated RL completions do). Each draw is planned by
``plan.plan`` over DP ranks under a token budget per micro-batch, packed and
unpacked, and compared on the same lengths with:
- ``naive``: fixed-size micro-batches padded to the longest sample of the
  batch (``plan.naive_padding_fraction``);
- ``fixed_dynamic``: fixed-size micro-batches in arrival order, each padded
  to its own longest sample (what a plain data loader with dynamic padding does).

Padding fraction = padded positions / all positions. Target: the planner's
padding <= 5%. Also reported: the attention work a dense mask wastes (packed
rows attend block-diagonally but a dense mask computes every pair; padded rows
compute padding), micro-batches on the busiest rank, and token balance across
DP ranks (max / mean), since the slowest rank sets the step time.
"""

from __future__ import annotations

import random
import statistics
import time

from _common import Ratio, parser, summary, write_result

TARGET = 0.05


def draw_lengths(dist: str, n: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = min(max(int(rng.lognormvariate(5.5, 0.6)), 16), 2048)  # median ~245
        if dist == "lognormal":
            completion = int(rng.lognormvariate(7.0, 1.0))  # median ~1100
        elif dist == "pareto":
            completion = int(256 * rng.paretovariate(0.9))
        else:
            raise ValueError(f"unknown distribution {dist!r}")
        out.append(min(prompt + max(completion, 1), max_len))
    return out


def fixed_dynamic_padding(lengths: list[int], dp: int, micro_batch_size: int) -> float:
    """Arrival order, contiguous shares per rank, fixed-size micro-batches padded to their max."""
    from megatron_grpo.train.plan import split_evenly

    real = padded = 0
    for share in split_evenly(lengths, dp):
        for i in range(0, len(share), micro_batch_size):
            mb = share[i : i + micro_batch_size]
            padded += max(mb) * len(mb)
            real += sum(mb)
    return 1.0 - real / padded


def attention_waste(p, lengths: list[int]) -> float:
    """1 - useful score pairs / computed score pairs, with a dense mask per row."""
    useful = computed = 0
    for rank in p.ranks:
        for mb in rank:
            width = max(sum(lengths[i] for i in row) for row in mb)
            computed += width * width * len(mb)
            useful += sum(lengths[i] ** 2 for row in mb for i in row)
    return 1.0 - useful / computed


def plan_stats(p, lengths: list[int]) -> dict[str, float]:
    loads = [sum(lengths[i] for mb in rank for row in mb for i in row) for rank in p.ranks]
    return {
        "padding": p.padding_fraction(lengths),
        "attention_waste": attention_waste(p, lengths),
        "max_micro_batches_per_rank": max(len(rank) for rank in p.ranks),
        "rank_token_imbalance": max(loads) / (sum(loads) / len(loads)),
    }


def parse_args():
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--max-len", type=int, default=16384, help="longest sample, tokens")
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="for the fixed-size baselines")
    p.add_argument("--draws", type=int, help="random draws per distribution (default 10)")
    return p.parse_args()


def measure_draws(dist: str, args, *, samples: int, draws: int, dp: int):
    """Per draw: the planner's stats (packed and unpacked), the baselines and the lengths."""
    from megatron_grpo.train.plan import naive_padding_fraction, plan

    rows: dict[str, list[float]] = {}
    stats: dict[str, list[dict[str, float]]] = {"packed": [], "unpacked": []}
    plan_seconds = []
    for seed in range(draws):
        lengths = draw_lengths(dist, samples, args.max_len, seed)
        for packed in (True, False):
            t0 = time.perf_counter()
            pl = plan(lengths, dp_size=dp, max_tokens=args.budget, packed=packed)
            plan_seconds.append(time.perf_counter() - t0)
            stats["packed" if packed else "unpacked"].append(plan_stats(pl, lengths))
        rows.setdefault("naive", []).append(naive_padding_fraction(lengths, args.micro_batch_size))
        rows.setdefault("fixed_dynamic", []).append(
            fixed_dynamic_padding(lengths, dp, args.micro_batch_size)
        )
        rows.setdefault("mean_len", []).append(statistics.fmean(lengths))
        rows.setdefault("max_len", []).append(max(lengths))
        rows.setdefault("at_cap", []).append(sum(x == args.max_len for x in lengths) / len(lengths))
    return rows, stats, plan_seconds


def report_mode(
    dist: str, mode: str, per_draw: list[dict[str, float]], rows: dict[str, list[float]]
) -> dict:
    """Print one planner mode's padding against the baselines; its JSON entry."""
    padding = [s["padding"] for s in per_draw]
    vs_naive = Ratio.of(
        f"{dist} {mode} planner padding / naive padding",
        [a / b for a, b in zip(padding, rows["naive"])],
    )
    vs_dynamic = Ratio.of(
        f"{dist} {mode} planner padding / fixed-size dynamic padding",
        [a / b for a, b in zip(padding, rows["fixed_dynamic"])],
    )
    mode_met = statistics.median(padding) <= TARGET
    print(vs_naive.line())
    print(vs_dynamic.line())
    print(
        f"  {dist} {mode}: padding median {statistics.median(padding):.2%} "
        f"(max {max(padding):.2%}; target <= {TARGET:.0%}: "
        f"{'met' if mode_met else 'NOT met'}); naive "
        f"{statistics.median(rows['naive']):.2%}, fixed-size dynamic "
        f"{statistics.median(rows['fixed_dynamic']):.2%}; dense-mask attention waste "
        f"{statistics.median(s['attention_waste'] for s in per_draw):.2%}"
    )
    return {
        "padding": summary(padding),
        "padding_vs_naive": vs_naive,
        "padding_vs_fixed_dynamic": vs_dynamic,
        "target_met": mode_met,
        **{
            k: summary([s[k] for s in per_draw])
            for k in ("attention_waste", "max_micro_batches_per_rank", "rank_token_imbalance")
        },
    }


def main() -> None:
    args = parse_args()
    samples = 64 if args.quick else args.samples
    draws = args.draws or (2 if args.quick else 10)
    dp = 2 if args.quick else args.dp
    results, met = {}, True
    for dist in ("lognormal", "pareto"):
        rows, stats, plan_seconds = measure_draws(dist, args, samples=samples, draws=draws, dp=dp)
        dist_result: dict = {
            "lengths": {k: summary(rows[k]) for k in ("mean_len", "max_len", "at_cap")},
            "naive_padding": summary(rows["naive"]),
            "fixed_dynamic_padding": summary(rows["fixed_dynamic"]),
            "plan_seconds": summary(plan_seconds),
        }
        for mode, per_draw in stats.items():
            dist_result[mode] = report_mode(dist, mode, per_draw, rows)
            met &= dist_result[mode]["target_met"]
        results[dist] = dist_result
    write_result(
        "packing",
        args.out,
        {
            "quick": args.quick,
            "target": {"planner padding": f"<= {TARGET:.0%}", "met": met},
            "settings": {
                "samples": samples,
                "dp": dp,
                "max_len": args.max_len,
                "budget": args.budget,
                "micro_batch_size": args.micro_batch_size,
                "draws": draws,
            },
            "distributions": results,
        },
    )


if __name__ == "__main__":
    main()
