"""The device layer, torch's side: lets megatron-core run on CPU (gloo) when CUDA is absent.

megatron-core assumes CUDA in a handful of places: ``device="cuda"`` factory
calls (schedules, causal masks, grad clipping, also in the forward that activation
recomputation reruns during backward), ``torch.cuda.current_device()``
(p2p communication, DDP buffers, rotary embeddings), the CUDA RNG behind the
model-parallel RNG tracker, and a ``param.grad.type() == 'torch.cuda.FloatTensor'``
assertion in grad clipping. Its MoE layer copies its split sizes to the host on a side
``torch.cuda.Stream`` and waits on an event. On a machine without CUDA, :func:`install`
routes all of them to the CPU through a ``TorchFunctionMode`` and ten ``torch.cuda``
stand-ins. With CUDA present it does nothing, so the same code runs unchanged on GPUs with
nccl and Transformer Engine.

This module holds every patch of torch and every call of a private torch API (the default
store, an NCCL group's timeout), declared in ``TORCH``. The patches of megatron-core that
the CPU needs besides are in ``mcore.compat``, whose ``install`` calls this one. Only these
two modules know about the difference between CPU and GPU.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_grpo.internals import Library, Target

_CPU = torch.device("cpu")
_installed = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device tensors for compute live on: the local GPU, or the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def distributed_backend() -> str:
    return "nccl" if cuda_available() else "gloo"


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU and answers CUDA tensor type names.

    Every torch call of the thread goes through it, so the common case (no
    ``device`` keyword, not one of the three tensor methods) does as little as it can.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                kwargs = {**kwargs, "device": _CPU}
        else:
            kwargs = _NO_KWARGS
        if func in _TENSOR_METHODS:
            return _tensor_method(func, args, kwargs)
        return func(*args, **kwargs)


_NO_KWARGS: dict[str, Any] = {}
_TENSOR_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type})


def _tensor_method(func, args: tuple, kwargs: dict[str, Any]) -> Any:
    if func is torch.Tensor.cuda:
        return args[0]
    if func is torch.Tensor.to:
        args = tuple(_CPU if _is_cuda(a) else a for a in args)
    elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
        # Grad clipping asserts grads are 'torch.cuda.FloatTensor'.
        return func(*args).replace("torch.", "torch.cuda.", 1)
    return func(*args, **kwargs)


def cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    """Stands in for the CUDA generator's ``get_rng_state``: the CPU generator's state."""
    return torch.get_rng_state()


def set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    """Stands in for the CUDA generator's ``set_rng_state``."""
    torch.set_rng_state(new_state)


class _HostEvent:
    """A CUDA event on the host: work is already done when it is recorded."""

    def record(self, *_args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *_args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream on the host: everything runs in order, so waits are no-ops."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, event: _HostEvent | None = None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def install() -> None:
    """Activate the CPU stand-ins for CUDA in torch. Idempotent; a no-op when CUDA is present.

    The megatron-core half of the layer is ``mcore.compat.install``, which calls this.
    """
    global _installed
    if _installed or cuda_available():
        return
    # Each replaces a torch.cuda attribute that megatron-core calls unconditionally.
    # p2p communication, DDP buffers and rotary embeddings place tensors on the current device.
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment,return-value]
    # Timers, the schedules and checkpoint preloading wait for the GPU; the host never lags.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # The model-parallel RNG tracker saves, seeds and restores the CUDA generator around every
    # fork (attention forks it even with dropout 0): the CPU generator stands in.
    torch.cuda.get_rng_state = cpu_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = set_cpu_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = cpu_rng_state  # type: ignore[assignment]
    # The MoE alltoall dispatcher copies its split sizes to the host on a side stream and
    # waits on an event: on the host everything already ran in order.
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _HostEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    _CudaToCpuMode().__enter__()
    _installed = True


def in_cpu_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside the function mode: for code torch runs outside it (autograd's
    backward), which would otherwise see CUDA placements again."""

    def run(*args: Any) -> Any:
        with _CudaToCpuMode():
            return fn(*args)

    return run


# --------------------------------------------------------------------------- private torch API


def default_store() -> Any:
    """torch.distributed's own store (the TCPStore of the main rank under torchrun): torch
    has no public accessor for it."""
    return dist.distributed_c10d._get_default_store()


def nccl_options(timeout: datetime.timedelta) -> Any:
    """``ProcessGroupNCCL.Options`` with ``timeout``: its constructor takes none, and torch's
    own group helper sets the private ``_timeout`` the same way."""
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def in_backward() -> bool:
    """Whether this runs inside the autograd engine's backward pass (a recomputed forward of
    activation checkpointing does)."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------- declared targets

_CUDA_STAND_IN = "replaced on CPU by device.install: {}"
TORCH = Library(
    distribution="torch",
    tested="2.13.0",
    compat_module="megatron_grpo/mcore/device.py",
    targets=(
        *(
            Target("torch.cuda", attr, _CUDA_STAND_IN.format(why))
            for attr, why in (
                ("current_device", "the CPU device, for megatron-core's current-device tensors"),
                ("synchronize", "a no-op"),
                ("get_rng_state", "the CPU generator, for the model-parallel RNG tracker"),
                ("set_rng_state", "the CPU generator, for the model-parallel RNG tracker"),
                ("manual_seed", "torch.manual_seed, for the model-parallel RNG tracker"),
                ("random.get_rng_state", "the CPU generator, for the model-parallel RNG tracker"),
                ("Stream", "a host stream, for the MoE dispatcher's side stream"),
                ("Event", "a host event, for the MoE dispatcher's copy-done event"),
                ("current_stream", "the host stream, for the MoE dispatcher"),
                ("stream", "a null context, for the MoE dispatcher"),
            )
        ),
        Target(
            "torch.overrides",
            "TorchFunctionMode.__torch_function__",
            "subclassed by the device layer to move CUDA placements to the CPU",
            params=("func", "types", "args", "kwargs"),
        ),
        Target(
            "torch.distributed.distributed_c10d",
            "_get_default_store",
            "called by device.default_store: the main-rank wait's store (train/main_wait.py)",
        ),
        Target(
            "torch._C",
            "_current_graph_task_id",
            "called by device.in_backward: -1 outside the autograd engine (routing replay's "
            "recomputed routers)",
        ),
        Target(
            "torch._C._distributed_c10d",
            "Backend.Options._timeout",
            "set by device.nccl_options: the timeout of an NCCL weight-update group",
        ),
    ),
)
"""torch's internals that this package patches or calls; ``mcore.compat.install`` checks
them at start-up (``internals.check``)."""
