"""Small checkpoints written by the saving process itself, with no helper processes.

megatron-core's ``torch_dist`` save writes each rank's files from forked processes
(one per file) and collects their results through a queue served by a ``spawn``-ed
``multiprocessing`` manager, which then lives as long as the trainer: a second Python
process per rank, hundreds of MB, for checkpoints of a few MB. ``writes_in_process``
has the same files written one after the other in this process and the results
handed over in a plain queue; the files and their metadata are the same.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from typing import Any

import torch

IN_PROCESS_BYTES = 1 << 30
"""A rank writes its checkpoint files itself below this many bytes of tensors."""


def local_bytes(state: Any) -> int:
    """Bytes of the tensors a sharded state dict holds on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for value in nested_values(state):
        data = getattr(value, "data", value)
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


@contextlib.contextmanager
def writes_in_process() -> Iterator[None]:
    """While active, megatron-core's ``torch_dist`` saves write from this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    writer = fsa.FileSystemWriterAsync
    saved = fsa._get_write_results_queue, writer.__dict__["write_preloaded_data_multiproc"]
    fsa._get_write_results_queue = queue.Queue  # type: ignore[assignment]
    writer.write_preloaded_data_multiproc = staticmethod(_write_buckets)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        fsa._get_write_results_queue = saved[0]
        writer.write_preloaded_data_multiproc = saved[1]  # type: ignore[method-assign]


def _write_buckets(
    transform_list: list, use_msc: bool, rank: int, write_buckets: list, results: Any
) -> None:
    """``write_preloaded_data_multiproc`` without the processes: each bucket's file in
    turn; the results (or the first error) into ``results``, as megatron-core reads them."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    done: dict[int, Any] = {}
    local: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    extra = {"use_msc": True} if use_msc else {}
    for index, bucket in enumerate(write_buckets):
        count.put(index)
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, index, bucket, local, count, True, **extra
        )
        _, written = local.get()
        if isinstance(written, Exception):
            results.put(written)
            return
        done[index] = written
    results.put(done)
