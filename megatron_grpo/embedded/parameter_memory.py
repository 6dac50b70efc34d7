"""A model's parameters freed and allocated again, for ``/release_memory_occupation``.

``release_parameters`` points every parameter at an empty tensor, so that its memory goes
back to the system once nothing else holds it: anonymous memory through glibc
(``return_freed_memory`` asks it to give back what it keeps), a model loaded from
safetensors by unmapping its file. ``ReleasedParameters.resume`` gives each parameter new
zeroed memory of its shape and dtype, written so that it is resident again; the values are
the next weight update's to bring, as in SGLang without a CPU backup. Buffers (rotary
frequencies) are small and stay, where SGLang keeps a copy of them and restores it.

A tied parameter (the input embedding and the output head) is one ``Parameter`` object,
freed and allocated once.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class _Slot:
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class ReleasedParameters:
    """What ``release_parameters`` freed, to allocate again with ``resume``."""

    slots: tuple[_Slot, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.shape.numel() * s.dtype.itemsize for s in self.slots)

    def resume(self) -> None:
        """New zeroed memory for each parameter, of its shape, dtype and device."""
        with torch.no_grad():
            for s in self.slots:
                s.param.data = torch.zeros(s.shape, dtype=s.dtype, device=s.device)


def release_parameters(model: nn.Module) -> ReleasedParameters:
    """Free the memory of every parameter of ``model`` (they become empty tensors)."""
    slots = []
    with torch.no_grad():
        for param in model.parameters():  # each Parameter object once: tied ones too
            slots.append(_Slot(param, param.shape, param.dtype, param.device))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return_freed_memory()
    return ReleasedParameters(tuple(slots))


def return_freed_memory() -> None:
    """Ask glibc to return the free memory it keeps to the system (``malloc_trim``), so
    that the resident set drops; nothing where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
