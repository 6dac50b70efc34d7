"""Batch planning: which samples go to which DP rank and micro-batch.

Two steps, both pure:
1. ``balance``: split the global batch over DP ranks so that their token
   counts are close (greedy longest-first onto the least-loaded rank). The
   loss does not care where a sample lands (its weight comes from global
   counts), so this is free to optimize for speed.
2. ``pack``: within a rank, fill micro-batches up to a token budget. Packed
   micro-batches are one row of samples end to end (first-fit decreasing),
   so the only padding is none at all; unpacked ones hold runs of rows of
   similar length, split where padded positions plus a fixed cost per
   micro-batch are least, so padding to the longest stays small.

Ranks may end up with different numbers of micro-batches: megatron-core's
DDP reduces gradients once after the whole schedule, and every pipeline
stage of one DP rank sees the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Plan:
    """rank -> micro-batch -> row -> sample indices into the global batch."""

    ranks: list[list[list[list[int]]]]

    def micro_batches(self, dp_rank: int) -> list[list[list[int]]]:
        return self.ranks[dp_rank]

    def padding_fraction(self, lengths: Sequence[int]) -> float:
        """Padded positions / all positions, over every micro-batch of every rank."""
        real = padded = 0
        for rank in self.ranks:
            for mb in rank:
                width = max(sum(lengths[i] for i in row) for row in mb)
                padded += width * len(mb)
                real += sum(lengths[i] for row in mb for i in row)
        return 1.0 - real / padded if padded else 0.0


def balance(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank, token counts balanced; each rank sorted by index."""
    if len(lengths) < dp_size:
        raise ValueError(
            f"the global batch has {len(lengths)} samples, fewer than the {dp_size} DP ranks"
        )
    loads = [0] * dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], len(ranks[r]), r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in ranks]


def pack(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int, *, packed: bool
) -> list[list[list[int]]]:
    """Micro-batches of rows within ``max_tokens`` positions each (padding included)."""
    too_long = [i for i in indices if lengths[i] > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sample {i} has {lengths[i]} tokens, more than the micro-batch budget "
            f"train.max_tokens_per_micro_batch={max_tokens}"
        )
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    if packed:  # first-fit decreasing: each micro-batch is one packed row
        bins: list[list[int]] = []
        room: list[int] = []
        for i in order:
            b = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
            if b is None:
                bins.append([])
                room.append(max_tokens)
                b = len(bins) - 1
            bins[b].append(i)
            room[b] -= lengths[i]
        return [[row] for row in bins]
    return _padded_rows(order, lengths, max_tokens)


MICRO_BATCH_COST = 1 / 16
"""Fixed cost of one micro-batch (launches, schedule, a smaller kernel), as a fraction of
the token budget: the unpacked planner trades this against padded positions."""


def _padded_rows(order: Sequence[int], lengths: Sequence[int], max_tokens: int):
    """Unpacked micro-batches: contiguous runs of ``order`` (longest first), each padded
    to its first row. The split minimizes padded positions + MICRO_BATCH_COST x budget per
    micro-batch (dynamic programming; a greedy fill pads ~6% on long-tailed lengths, this
    ~4%, for a few more micro-batches)."""
    n = len(order)
    width = np.array([lengths[i] for i in order], dtype=np.float64)
    overhead = MICRO_BATCH_COST * max_tokens
    best = np.full(n + 1, np.inf)  # best[i]: cost of the first i rows
    best[0] = 0.0
    start = np.zeros(n + 1, dtype=np.int64)  # where the last micro-batch of best[i] starts
    for j in range(n):  # a micro-batch starting at row j, as wide as row j, of 1..cap rows
        stop = min(n, j + max_tokens // int(width[j]))
        cost = best[j] + overhead + width[j] * np.arange(1, stop - j + 1)
        better = cost < best[j + 1 : stop + 1]
        best[j + 1 : stop + 1][better] = cost[better]
        start[j + 1 : stop + 1][better] = j
    bounds = [n]
    while bounds[-1]:
        bounds.append(int(start[bounds[-1]]))
    bounds.reverse()
    return [[[order[t]] for t in range(a, b)] for a, b in zip(bounds, bounds[1:])]


def split_to_multiple(micro_batches: list[list[list[int]]], multiple: int) -> list[list[list[int]]]:
    """Split micro-batches until there are a positive multiple of ``multiple`` of them.

    The interleaved (virtual pipeline) schedule runs micro-batches in groups of PP. The
    micro-batch with the most samples is halved each time: its rows, or the samples of
    its one packed row.
    """
    out = [list(mb) for mb in micro_batches]
    while not out or len(out) % multiple:
        if not _split_fullest(out):
            raise ValueError(
                f"{sum(map(_num_samples, out))} samples on a DP rank cannot make a multiple of "
                f"{multiple} micro-batches, as the interleaved pipeline schedule (parallel.vpp) "
                "needs; give each DP rank more samples (train.global_batch_size) or set "
                "parallel.vpp to null"
            )
    return out


def split_to_count(micro_batches: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """``count`` micro-batches: the fullest halved while one holds two samples or more, then
    idle ones (no rows) added. Expert parallelism needs it: the all-to-all of every MoE
    layer pairs the forward passes of its EP ranks, so they run equally many."""
    out = [list(mb) for mb in micro_batches]
    while len(out) < count and _split_fullest(out):
        pass
    return out + [[] for _ in range(count - len(out))]


def _num_samples(mb: list[list[int]]) -> int:
    return sum(len(row) for row in mb)


def _split_fullest(out: list[list[list[int]]]) -> bool:
    """Halve, in place, the micro-batch with the most samples (its rows, or the samples of
    its one packed row); False when none holds two."""
    sizes = [_num_samples(mb) for mb in out]
    if not out or max(sizes) < 2:
        return False
    i = max(range(len(out)), key=lambda k: (sizes[k], -k))
    mb = out[i]
    if len(mb) > 1:
        halves = [mb[: len(mb) // 2], mb[len(mb) // 2 :]]
    else:
        row = mb[0]
        halves = [[row[: len(row) // 2]], [row[len(row) // 2 :]]]
    out[i : i + 1] = halves
    return True


def plan(lengths: Sequence[int], *, dp_size: int, max_tokens: int, packed: bool) -> Plan:
    return Plan([pack(r, lengths, max_tokens, packed=packed) for r in balance(lengths, dp_size)])


def naive_padding_fraction(lengths: Sequence[int], micro_batch_size: int) -> float:
    """Padding of fixed-size micro-batches padded to the longest sample of the batch."""
    width = max(lengths)
    num_mb = -(-len(lengths) // micro_batch_size)
    return 1.0 - sum(lengths) / (width * micro_batch_size * num_mb)


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Split into ``parts`` contiguous runs whose sizes differ by at most one."""
    if parts < 1 or len(items) < parts:
        raise ValueError(f"cannot split {len(items)} items into {parts} non-empty parts")
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
