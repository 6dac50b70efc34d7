"""What lies inside megatron-core's wrappers of a model chunk."""

from __future__ import annotations

from typing import Any

import torch


def unwrap(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside a chunk's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module  # type: ignore[assignment]
    return chunk
