"""The device layer: lets megatron-core run on CPU (gloo) when CUDA is absent.

megatron-core assumes CUDA in a handful of places: ``device="cuda"`` factory
calls (schedules, causal masks, grad clipping, also in the forward that activation
recomputation reruns during backward), ``torch.cuda.current_device()``
(p2p communication, DDP buffers, rotary embeddings), the CUDA RNG behind the
model-parallel RNG tracker, and a ``param.grad.type() == 'torch.cuda.FloatTensor'``
assertion in grad clipping. Its MoE layer adds three: the alltoall token dispatcher
copies its split sizes to the host on a side ``torch.cuda.Stream`` and waits on an
event, and hands ``all_to_all_single`` those sizes as numpy arrays only when the
tensors were on a GPU (CPU tensors stay tensors, which gloo refuses); the router's
gate names ``te_general_gemm``, defined only when Transformer Engine is importable.
On a machine without CUDA, :func:`install` routes all of them to the CPU. With CUDA
present it does nothing, so the same code runs unchanged on GPUs with nccl and
Transformer Engine.

This is the only module in the project that knows about the difference.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

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


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
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


def _host_split_sizes(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors already on the host: the
    numpy array that ``all_to_all_single`` takes as split sizes, as the GPU path gives."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _install_moe_stand_ins() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _HostEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes  # type: ignore[attr-defined]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def install() -> None:
    """Activate the CPU stand-ins for CUDA. Idempotent; a no-op when CUDA is present."""
    global _installed
    if _installed or cuda_available():
        return
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_cpu_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # Activation recomputation reruns the forward inside autograd's backward, which torch
    # runs outside the function mode: the recomputed forward needs the mode too.
    for fn in (mcore_random.CheckpointFunction, mcore_random.CheckpointWithoutOutputFunction):
        fn.backward = staticmethod(_in_cpu_mode(fn.backward))  # type: ignore[method-assign]
    _install_moe_stand_ins()
    _CudaToCpuMode().__enter__()
    _installed = True


def _in_cpu_mode(backward):
    def run(*args: Any) -> Any:
        with _CudaToCpuMode():
            return backward(*args)

    return run
