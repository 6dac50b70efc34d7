"""Weights into a real SGLang server by ``/update_weights_from_tensor``: its tensor format.

``/update_weights_from_tensor`` takes, for each TP rank of
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
What SGLang unpickles it with is declared in ``sglang_api.compat``.
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch import Tensor


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
