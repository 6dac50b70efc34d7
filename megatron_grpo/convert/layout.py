"""Pure tensor re-layouts between HF's separate projections and megatron's fused ones.

All functions only reshape, slice, concatenate and copy, so conversions are
bitwise invertible. Results never share storage with their inputs: callers
save them with safetensors, which refuses tensors that alias each other.
"""

from __future__ import annotations

import torch


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int
) -> torch.Tensor:
    """Megatron's fused QKV weight or bias from HF's separate Q, K, V projections.

    Megatron lays the fused projection out per query group, ``[q heads of
    group g; k_g; v_g]`` for g in groups, so a TP rank's contiguous dim-0
    slice holds whole groups. Works for weights ``[out, in]`` and biases ``[out]``.
    """
    rest = q.shape[1:]
    groups = [t.reshape(num_query_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's (Q, K, V) from megatron's fused per-group QKV weight or bias (see ``fuse_qkv``)."""
    heads_per_group = num_attention_heads // num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).clone() for t in (q, k, v))  # type: ignore[return-value]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Megatron's fused SwiGLU ``linear_fc1`` weight: ``[gate; up]`` along dim 0."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) from a fused ``linear_fc1`` weight; inverse of ``fuse_gate_up``."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.clone(), up.clone()


def resize_vocab(weight: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A new ``[num_rows, hidden]`` copy: trimmed, or padded with zero rows.

    Megatron pads the vocabulary so every TP rank holds an equal slice; the
    padding rows are never a real token, so zeros in and dropped out.
    """
    out = weight.new_zeros(num_rows, *weight.shape[1:])
    keep = min(num_rows, weight.shape[0])
    out[:keep] = weight[:keep]
    return out
