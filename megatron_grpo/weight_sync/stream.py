"""A stage's weights as a stream: size-bounded buckets, each delivered while the next is made.

- ``buckets``: consecutive groups of tensors of at most a given size;
- ``pipelined``: deliver each item while the next one is produced on a worker thread;
- ``drain``: run a producer to its end (its TP peers wait in its gathers).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

from torch import Tensor

_END = object()


def buckets(
    named: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], max_bytes: int
) -> Iterator[dict[str, Tensor]]:
    """Consecutive groups of tensors of at most ``max_bytes`` each (a bigger tensor goes alone)."""
    pairs = named.items() if isinstance(named, Mapping) else named
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


async def pipelined(items: Iterator[Any], deliver: Callable[[Any], Awaitable[None]]) -> None:
    """``deliver`` each item in order, producing the next one (on a worker thread) while the
    previous one is being delivered."""
    pending: asyncio.Future[None] | None = None
    try:
        while True:
            item = await asyncio.to_thread(next, items, _END)
            if pending is not None:
                try:
                    await pending
                except BaseException:
                    _discard(item)
                    raise
                pending = None
            if item is _END:
                return
            pending = asyncio.ensure_future(deliver(item))
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


def _discard(item: Any) -> None:
    """Free what an item that will not be delivered holds (shared memory)."""
    close = getattr(item, "close", None)
    if close is not None:
        close()


def drain(items: Iterator[Any]) -> None:
    """Run a producer to its end (its TP peers wait in its gathers)."""
    for _ in items:
        pass
