"""Whether each node's host memory can take what its ranks offload (``rollout.colocate``).

Before the first offload, every rank reports its host name, the bytes its learner offload
holds on the host (``mcore.offload.LearnerOffload.host_bytes``) and the node's available
memory (``MemAvailable`` of ``/proc/meminfo``). The ranks of a node share its memory: their
bytes are added up and must fit in the node's available memory (the least any of its ranks
saw) less ``rollout.colocate.host_memory_headroom_gib``. A node where they do not refuses
the run at start, by name, on every rank.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

GIB = 1 << 30


class HostMemoryError(ValueError):
    """The learner's offload does not fit a node's host memory."""


@dataclass(frozen=True)
class RankReport:
    rank: int
    node: str
    offload_bytes: int
    available_bytes: int
    """The node's available memory as this rank read it."""


@dataclass(frozen=True)
class NodeShortfall:
    node: str
    per_rank: dict[int, int]
    """Offloaded bytes of each of the node's ranks, by global rank."""
    available_bytes: int
    headroom_bytes: int

    @property
    def needed_bytes(self) -> int:
        return sum(self.per_rank.values())


def shortfalls(reports: Sequence[RankReport], headroom_bytes: int) -> list[NodeShortfall]:
    """The nodes whose ranks together offload more than their available memory less
    ``headroom_bytes``, in order of their first rank."""
    nodes: dict[str, list[RankReport]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        nodes.setdefault(report.node, []).append(report)
    out = []
    for node, ranks in nodes.items():
        available = min(r.available_bytes for r in ranks)
        per_rank = {r.rank: r.offload_bytes for r in ranks}
        if sum(per_rank.values()) > available - headroom_bytes:
            out.append(NodeShortfall(node, per_rank, available, headroom_bytes))
    return out


def refusal(short: NodeShortfall, parts: Sequence[str]) -> str:
    """What a node that cannot take the offload is told, naming the keys to change."""
    ranks = ", ".join(f"rank {r} {_gib(b)}" for r, b in short.per_rank.items())
    left = short.available_bytes - short.headroom_bytes
    return (
        f"rollout.colocate.offload={list(parts)} does not fit host memory on node "
        f"{short.node}: its {len(short.per_rank)} ranks offload {ranks}, "
        f"{_gib(short.needed_bytes)} ({short.needed_bytes} bytes) together; the node has "
        f"{_gib(short.available_bytes)} available, which "
        f"rollout.colocate.host_memory_headroom_gib={short.headroom_bytes / GIB:g} leaves at "
        f"{_gib(left)}. Offload less (rollout.colocate.offload), lower "
        "rollout.colocate.host_memory_headroom_gib, or spread the ranks over more nodes"
    )


def available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The host's available memory: what the kernel counts as usable without swapping."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # given in kB
    raise RuntimeError(f"{meminfo} has no MemAvailable line: cannot size the host offload")


def check_host_memory(
    offload_bytes: int, parts: Sequence[str], headroom_gib: float, group: dist.ProcessGroup | None
) -> None:
    """Raise :class:`HostMemoryError` on every rank of ``group`` (all of them: the world)
    when some node cannot take what its ranks offload. Collective over ``group`` (None: the
    world)."""
    mine = RankReport(dist.get_rank(), socket.gethostname(), offload_bytes, available_bytes())
    reports: list[RankReport | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    short = shortfalls([r for r in reports if r is not None], int(headroom_gib * GIB))
    if short:
        raise HostMemoryError("; ".join(refusal(s, parts) for s in short))


def _gib(num_bytes: int) -> str:
    if abs(num_bytes) < GIB:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / GIB:.2f} GiB"
