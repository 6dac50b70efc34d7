"""The device layer: lets megatron-core run on CPU (gloo) when CUDA is absent.

megatron-core assumes CUDA in a handful of places: ``device="cuda"`` factory
calls (schedules, causal masks, grad clipping, also in the forward that activation
recomputation reruns during backward), ``torch.cuda.current_device()``
(p2p communication, DDP buffers, rotary embeddings), the CUDA RNG behind the
model-parallel RNG tracker, and a ``param.grad.type() == 'torch.cuda.FloatTensor'``
assertion in grad clipping. On a machine without CUDA, :func:`install` routes all
of them to the CPU. With CUDA present it does nothing, so the same code runs
unchanged on GPUs with nccl and Transformer Engine.

This is the only module in the project that knows about the difference.
"""

from __future__ import annotations

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
    """Rewrites CUDA placements to the CPU and answers CUDA tensor type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
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
    _CudaToCpuMode().__enter__()
    _installed = True


def _in_cpu_mode(backward):
    def run(*args: Any) -> Any:
        with _CudaToCpuMode():
            return backward(*args)

    return run
