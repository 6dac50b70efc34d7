"""Tensor-parallel shards of full megatron tensors, and the pipeline layer split.

A "full" tensor is what a TP=1 model holds (``weights.hf_to_megatron``
output; vocab padded to ``padded_vocab_size(1)``). ``shard_for_rank`` cuts
the slice a TP rank's megatron layer holds, ``unshard`` joins the slices
back, bitwise. The layouts follow megatron-core's parallel layers:

- column-parallel ``linear_qkv`` (weight and bias): dim 0. The fused QKV is
  laid out per query group, so a contiguous dim-0 slice is whole groups.
- ``linear_fc1``: column-parallel too, but each rank holds its own
  ``[gate_r; up_r]``, not a slice of ``[gate; up]``.
- row-parallel ``linear_proj``, ``linear_fc2``: dim 1.
- embedding and output layer: vocab rows, padded to ``padded_vocab_size(tp)``.
- norms: replicated.
- a MoE layer's router, and its experts (expert TP is 1: whole experts, over EP instead):
  replicated over TP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.layout import resize_vocab
from megatron_grpo.convert.weights import MEGATRON_EMBEDDING, MEGATRON_OUTPUT

TpLayout = Literal["column", "gate_up", "row", "vocab", "replicated"]

_SUFFIX_LAYOUTS: dict[str, TpLayout] = {
    "self_attention.linear_qkv.weight": "column",
    "self_attention.linear_qkv.bias": "column",
    "mlp.linear_fc1.weight": "gate_up",
    "self_attention.linear_proj.weight": "row",
    "mlp.linear_fc2.weight": "row",
}


def tp_layout(name: str) -> TpLayout:
    """How megatron splits parameter ``name`` (either spec's name) over TP ranks."""
    if name.endswith(("layernorm.weight", "layer_norm_weight", ".mlp.router.weight")):
        return "replicated"
    if ".mlp.experts." in name:
        return "replicated"
    if name in (MEGATRON_EMBEDDING, MEGATRON_OUTPUT):
        return "vocab"
    for suffix, layout in _SUFFIX_LAYOUTS.items():
        if name.endswith("." + suffix):
            return layout
    raise ValueError(f"no tensor-parallel layout is known for parameter {name!r}")


def _slice(t: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {t.shape[dim]} is not divisible by TP={size}")
    return t.chunk(size, dim=dim)[rank].contiguous()


def _vocab_shard(full: torch.Tensor, rank: int, rows_per_rank: int) -> torch.Tensor:
    """Rows ``[rank * n, (rank + 1) * n)`` of ``full``, zero past its end; one shard of memory."""
    out = full.new_zeros(rows_per_rank, *full.shape[1:])
    start = rank * rows_per_rank
    stop = min(start + rows_per_rank, full.shape[0])
    if stop > start:
        out[: stop - start] = full[start:stop]
    return out


def shard_for_rank(
    full_name: str, full_tensor: torch.Tensor, tp_rank: int, tp_size: int, cfg: ModelConfig
) -> torch.Tensor:
    """The slice of a full megatron tensor that TP rank ``tp_rank`` of ``tp_size`` holds.

    Replicated tensors come back as they are; dim-0 slices may share memory
    with ``full_tensor``; everything else is a new tensor.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside TP={tp_size}")
    layout = tp_layout(full_name)
    if layout == "replicated":
        return full_tensor
    if layout == "vocab":
        if full_tensor.shape[0] < cfg.vocab_size:
            raise ValueError(
                f"{full_name} has {full_tensor.shape[0]} rows, fewer than "
                f"model.vocab_size={cfg.vocab_size}"
            )
        return _vocab_shard(full_tensor, tp_rank, cfg.padded_vocab_size(tp_size) // tp_size)
    if layout == "gate_up":
        gate, up = full_tensor.chunk(2, dim=0)
        parts = [_slice(t, 0, tp_rank, tp_size, full_name) for t in (gate, up)]
        return torch.cat(parts, dim=0)
    return _slice(full_tensor, 1 if layout == "row" else 0, tp_rank, tp_size, full_name)


def unshard(full_name: str, shards: Sequence[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in rank order; inverse of ``shard_for_rank``.

    Vocab tensors come back with ``padded_vocab_size(1)`` rows whatever the TP.
    """
    layout = tp_layout(full_name)
    if layout == "replicated":
        return shards[0]
    if layout == "vocab":
        return resize_vocab(torch.cat(list(shards), dim=0), cfg.padded_vocab_size(1))
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=0)
    return torch.cat(list(shards), dim=1 if layout == "row" else 0)


def unshard_stacked(full_name: str, stacked: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``unshard`` of every TP rank's shard stacked on a new dim 0 (``[tp, *shard]``): a view
    of ``stacked`` where the layout concatenates along dim 0 (vocab, column), else a copy.

    Vocab tensors keep the rows of ``padded_vocab_size(tp)``.
    """
    layout = tp_layout(full_name)
    if layout == "replicated":
        return stacked[0]
    if layout in ("vocab", "column"):
        return stacked.flatten(0, 1)
    return unshard(full_name, list(stacked), cfg)


# --------------------------------------------------------------------------- pipeline


class LayerLocation(NamedTuple):
    """Where a global decoder layer lives: pipeline rank, virtual stage, local index."""

    pp_rank: int
    vp_stage: int
    """Virtual pipeline stage (model chunk) on that rank; 0 without virtual stages."""
    local_index: int
    """The layer's index in that chunk's names (``decoder.layers.{local_index}``)."""


def _layers_per_chunk(num_layers: int, pp_size: int, vpp_size: int | None) -> int:
    chunks = pp_size * (vpp_size or 1)
    if num_layers % chunks:
        raise ValueError(
            f"model.num_layers={num_layers} is not divisible by PP({pp_size}) x "
            f"VPP({vpp_size or 1}) = {chunks} model chunks"
        )
    return num_layers // chunks


def chunk_layer_range(
    num_layers: int, pp_rank: int, pp_size: int, vp_stage: int = 0, vpp_size: int | None = None
) -> range:
    """Global indices of the layers held by one model chunk, in local order.

    Megatron's even split: chunks are ordered virtual stage first, then
    pipeline rank (interleaved 1F1B), and each holds a contiguous run.
    """
    per_chunk = _layers_per_chunk(num_layers, pp_size, vpp_size)
    start = (vp_stage * pp_size + pp_rank) * per_chunk
    return range(start, start + per_chunk)


def layer_location(
    layer_idx: int, num_layers: int, pp_size: int, vpp_size: int | None = None
) -> LayerLocation:
    """The pipeline rank, virtual stage and local index holding global layer ``layer_idx``."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer {layer_idx} is outside model.num_layers={num_layers}")
    per_chunk = _layers_per_chunk(num_layers, pp_size, vpp_size)
    vp_stage, pp_rank = divmod(layer_idx // per_chunk, pp_size)
    return LayerLocation(pp_rank, vp_stage, layer_idx % per_chunk)
