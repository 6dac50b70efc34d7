"""Weights into a real SGLang server: its tensor format, and a broadcast group with it.

Tensor format. ``/update_weights_from_tensor`` takes, for each TP rank of
the server, a base64 string of ``MultiprocessingSerializer.serialize(
[(hf_name, tensor), ...])``: a pickle made by ``ForkingPickler`` with
torch's multiprocessing reductions, which SGLang reads back with an
allow-list of torch rebuild functions (``SafeUnpickler``). Both come from
the standard library and torch, so the payload is built here without
importing sglang. The pickle holds no tensor data, only handles. For a server on
a GPU, from a process with a GPU, they are CUDA IPC handles to copies on this
process's GPU (``cuda_copies``), each naming its device by UUID as SGLang's own
senders do (``sglang.srt.utils.patch_torch``), so the server finds it whatever
``CUDA_VISIBLE_DEVICES`` each side has. Otherwise CPU tensors
are placed in named shared-memory files (torch's ``file_system`` sharing
strategy; a file descriptor cannot travel in an HTTP body). Hence:
- the server must run on the same machine (the same ``/dev/shm``);
- the tensors must stay referenced until the server has answered;
- each TP rank gets its own pickle: unpickling drops the reference that
  pickling took, once per pickle, and the files go when the last reference
  does. A server that fails before unpickling never drops its reference:
  that bucket's files then stay in ``/dev/shm``.

Broadcast group. For ``/init_weights_update_group`` +
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
(``names``/``dtypes``/``shapes``).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch import Tensor

from megatron_grpo.sglang_api.compat import update_group_store

# --------------------------------------------------------------------------- tensor format


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch's ``file_system`` sharing strategy for the duration (it is process-wide)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def shared_copies(named: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """CPU copies of ``named`` in named shared-memory files (one copy, no other allocation)."""
    out = {}
    with _file_system_sharing():
        for name, tensor in named.items():
            shared = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
            shared.copy_(tensor.detach())
            out[name] = shared
    return out


def cuda_copies(named: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Copies of ``named`` on their GPU, for CUDA IPC (one allocation each, so a handle shares
    no more than its tensor). A GPU tensor's copy stays on its device: this may run on a
    thread of its own, whose current device is not the rank's."""
    out = {}
    for name, tensor in named.items():
        device = (
            tensor.device if tensor.is_cuda else torch.device("cuda", torch.cuda.current_device())
        )
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        copy.copy_(tensor.detach())
        out[name] = copy
    return out


_CUDA_DEVICE_ARG = 6
"""Where ``rebuild_cuda_tensor``'s arguments hold the device index (torch's
``reduce_tensor``; SGLang's ``_REDUCE_TENSOR_ARG_DEVICE_INDEX``)."""


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_as_uuid(reduced: tuple[Any, tuple]) -> tuple[Any, tuple]:
    """torch's reduction of a CUDA tensor with its device index replaced by the device's
    UUID, which SGLang's receiving end maps to its own index; other reductions unchanged."""
    from torch.multiprocessing import reductions

    rebuild, args = reduced
    if rebuild is not reductions.rebuild_cuda_tensor:
        return reduced
    i = _CUDA_DEVICE_ARG
    return rebuild, (*args[:i], _device_uuid(args[i]), *args[i + 1 :])


def _reduce_tensor(tensor: Tensor) -> tuple[Any, tuple]:
    from torch.multiprocessing import reductions

    return device_as_uuid(reductions.reduce_tensor(tensor))


class _SGLangPickler(ForkingPickler):
    """torch's multiprocessing pickler, CUDA devices named by UUID (this pickler only)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = _reduce_tensor


def serialize_for_sglang(named: Mapping[str, Tensor]) -> str:
    """One TP rank's entry of ``serialized_named_tensors`` (tensors from ``shared_copies``
    or ``cuda_copies``)."""
    buffer = io.BytesIO()
    with _file_system_sharing():
        _SGLangPickler(buffer).dump([(name, tensor) for name, tensor in named.items()])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sglang_tensor_payload(
    shared: Mapping[str, Tensor], *, tp_size: int, weight_version: str, flush_cache: bool = True
) -> dict[str, Any]:
    """A ``/update_weights_from_tensor`` body for a server with ``tp_size`` ranks.

    Keep ``shared`` referenced until the server has answered.
    """
    return {
        "serialized_named_tensors": [serialize_for_sglang(shared) for _ in range(tp_size)],
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


# --------------------------------------------------------------------------- broadcast group


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
