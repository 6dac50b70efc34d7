"""A weight-broadcast group with a real SGLang server, as SGLang joins it; on both ends.

For ``/init_weights_update_group`` +
``/update_weights_from_distributed`` the trainer is rank 0 of a new process
group whose other ranks are the servers' TP workers. SGLang builds its end
with ``torch.distributed``'s rendezvous on ``tcp://master_address:port``
(rank 0 hosts the TCPStore) and prefixes of its own and of torch's
process-group helper (``sglang_compat.update_group_store``). The trainer's end
is built here from the same pieces directly: a ``TCPStore``, the same
prefixes, and a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object. Nothing is
registered with ``torch.distributed``'s global state, so the trainer's default
group and megatron-core's groups are not touched. Each tensor is then one
broadcast from rank 0, in the order the server was told
(``names``/``dtypes``/``shapes``). The embedded server joins the same way, as a
receiving rank (``embedded.weight_routes``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.sglang_api.compat import update_group_store


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang reads back with ``getattr(torch, name)``, e.g. ``float32``."""
    return str(dtype).removeprefix("torch.")


@dataclass
class UpdateGroup:
    """One end of a weight-broadcast process group: the sender (rank 0) or a receiver."""

    name: str
    world_size: int
    backend: str
    device: torch.device
    _store: Any
    _pg: Any
    rank: int = 0
    broken: bool = False
    """A broadcast failed part-way: the ranks are out of step, so the group must not be reused."""

    def _broadcast(self, buffer: Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._pg.broadcast([buffer], options).wait()

    def broadcast(self, tensors: Sequence[Tensor]) -> None:
        """Broadcast each tensor from rank 0, in order; blocks until each is sent."""
        for tensor in tensors:
            self._broadcast(tensor.detach().to(self.device).contiguous())

    def receive(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> dict[str, Tensor]:
        """The tensors rank 0 broadcasts, in the order announced (on a receiving rank)."""
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            buffer = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(buffer)
            out[name] = buffer
        return out

    def close(self) -> None:
        self._pg = None
        self._store = None


def open_update_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    rank: int = 0,
) -> UpdateGroup:
    """Join the group as ``rank``; rank 0 hosts its store. Blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )
    prefixed = update_group_store(store, group_name, backend)  # the server's end's prefixes
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        pg: Any = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        device = torch.device("cpu")
    elif backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        from megatron_grpo.mcore.device import nccl_options

        pg = ProcessGroupNCCL(prefixed, rank, world_size, nccl_options(timeout))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"weight-update group backend must be gloo or nccl, got {backend!r}")
    return UpdateGroup(
        name=group_name,
        world_size=world_size,
        backend=backend,
        device=device,
        _store=store,
        _pg=pg,
        rank=rank,
    )
