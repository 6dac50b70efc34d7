"""The layout-free view of a model: full (unsharded) tensors under TP=1, PP=1 names.

megatron-core's sharded state dict says, for every local shard, which slice of
which global tensor it is (``ShardedTensor.global_slice()``), including the
fused SwiGLU and per-query-group QKV layouts. That metadata is used here to
gather parameters, or their gradients, from every TP/PP rank into full
tensors named as a single-process GPTModel names them
(``decoder.layers.3.mlp.linear_fc1.weight``). The same names come out of every
layout, so two layouts can be compared tensor by tensor, and weight sync has
one source of truth to map to HF names.

``load_full_state`` goes the other way without any collective: each rank cuts
its own TP shard of the tensors its chunks hold (``convert.sharding``), reading
only those names, so a lazy Mapping over a checkpoint streams into the model.
It accepts either spec's norm names, so what the gather returns loads back.

The vocabulary is padded differently at each TP size; gathered tensors hold
only the tokenizer's ``vocab_size`` rows, and loaded ones may hold those or
any padded count (the padding rows are zeros when loaded and take no part in
the log-softmax).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.experts import global_expert_name, unstack_expert_axes
from megatron_grpo.convert.sharding import chunk_layer_range, shard_for_rank
from megatron_grpo.convert.weights import (
    MEGATRON_EMBEDDING,
    MEGATRON_OUTPUT,
    canonical_megatron_name,
    megatron_key_layer,
    with_layer_index,
)
from megatron_grpo.mcore.checkpoint import model_sharded_state_dict
from megatron_grpo.mcore.model import sync_params
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.wrappers import unwrap

_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _grad_of(view: Tensor, params: list[torch.nn.Parameter]) -> Tensor:
    """The gradient of ``view``, a view into one parameter's storage: the same view of that
    parameter's DDP ``main_grad`` (in its own, fp32, dtype).

    Parameters are not swapped for their gradients: changing a parameter's dtype would
    reset its gradient accumulator and with it DDP's hook.
    """
    for p in params:
        start = p.data_ptr()
        if start <= view.data_ptr() < start + p.numel() * p.element_size():
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            offset = (view.data_ptr() - start) // p.element_size()
            assert grad.is_contiguous() and p.is_contiguous()
            return grad.as_strided(view.shape, view.stride(), grad.storage_offset() + offset)
    raise AssertionError("a sharded tensor is not a view of any parameter")


def _local_shards(model: list) -> list[tuple[str, int, tuple[int, ...], tuple, Tensor]]:
    """(key, prepended axes, global shape, global slice, local view) per local shard."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model_sharded_state_dict(model)
    apply_factories(state)
    shards = []
    for sh in nested_values(state):
        if isinstance(sh, ShardedTensor):
            shards.append(
                (sh.key, sh.prepend_axis_num, tuple(sh.global_shape), sh.global_slice(), sh.data)
            )
    return shards


def _full_names(key: str, prepend: int, full: Tensor) -> dict[str, Tensor]:
    """Unstack a tensor with a prepended layer axis (and, for experts, an expert axis) into
    per-layer (per-expert) state-dict names."""
    if prepend == 0:
        return {key: full}
    if prepend == 2:
        return unstack_expert_axes(key, full)
    assert prepend == 1, f"{key}: {prepend} prepended axes are not supported"
    stem, _, leaf = key.rpartition("layers.")
    return {f"{stem}layers.{i}.{leaf}": full[i] for i in range(full.shape[0])}


def gather_full_state(
    model: list,
    ctx: ParallelContext,
    *,
    vocab_size: int,
    grads: bool = False,
    dst: int = 0,
    replica_spread: dict[str, float] | None = None,
) -> dict[str, Tensor] | None:
    """Full tensors on global rank ``dst`` (None elsewhere): parameters, or gradients.

    Gathers the whole model onto one rank: meant for checks, small models and
    conversion, not for streaming a large model. Parameters are brought up to date first
    (``sync_params``); gradients are DDP's reduced ``main_grad``, which the distributed
    optimizer holds only on each rank's own shard, gathered in their own (fp32) dtype.

    Several ranks hold copies of the same slice (DP replicas, TP-replicated norms);
    with ``replica_spread`` given, it receives for each tensor the largest difference
    between copies (0.0 when they agree), on ``dst``.
    """
    if not grads:
        sync_params(model)
    params = [p for chunk in model for p in chunk.parameters()]
    local = [
        (
            key,
            prepend,
            shape,
            sl,
            (_grad_of(data, params) if grads else data).detach().to("cpu", copy=True),
        )
        for key, prepend, shape, sl, data in _local_shards(model)
    ]
    gathered: list | None = [None] * ctx.world_size if ctx.rank == dst else None
    dist.gather_object(local, gathered, dst=dst)
    if gathered is None:
        return None
    full: dict[str, Tensor] = {}
    prepends: dict[str, int] = {}
    for rank_shards in gathered:
        for key, prepend, shape, sl, data in rank_shards:
            if key not in full:
                full[key] = torch.full(shape, float("nan"), dtype=data.dtype)
                prepends[key] = prepend
            region = full[key][sl]
            held = ~torch.isnan(region)
            if replica_spread is not None and bool(held.any()):
                spread = float((region[held] - data[held]).abs().max())
                replica_spread[key] = max(replica_spread.get(key, 0.0), spread)
            full[key][sl] = data
    out: dict[str, Tensor] = {}
    for key, tensor in full.items():
        if torch.isnan(tensor).any():
            raise RuntimeError(f"{key}: some slices were not held by any rank")
        if key in _VOCAB_KEYS:
            tensor = tensor[:vocab_size]
        out.update(_full_names(key, prepends[key], tensor))
    return out


def chunk_params(
    model_chunk: torch.nn.Module, cfg: ModelConfig, ctx: ParallelContext
) -> dict[str, Tensor]:
    """A chunk's parameters under global (layer and expert), local-spec names
    (``_extra_state`` left out)."""
    model = unwrap(model_chunk)
    num_local_experts = (cfg.num_experts or 0) // ctx.dims.ep
    vp_stage = getattr(model, "vp_stage", None) or 0
    layers = chunk_layer_range(cfg.num_layers, ctx.pp_rank, ctx.dims.pp, vp_stage, ctx.dims.vpp)
    params = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        local = megatron_key_layer(name)
        full_name = name if local is None else with_layer_index(name, layers[local])
        full_name = global_expert_name(full_name, ctx.ep_rank, num_local_experts)
        params[canonical_megatron_name(full_name)] = tensor
    return params


@torch.no_grad()
def load_full_state(
    model: list, full: Mapping[str, Tensor], cfg: ModelConfig, ctx: ParallelContext
) -> None:
    """Copy this rank's TP shard of each full tensor into its model chunks, in place.

    ``full`` maps global (TP=1, PP=1) names of either spec to full tensors;
    only the names these chunks hold are read, in model order (embedding,
    layers, final norm, head), so a lazy Mapping holding one layer at a time
    works. With tied embeddings and PP > 1 the last stage's copy of the
    embedding (``output_layer.weight``) is loaded from the embedding.
    """
    names = {canonical_megatron_name(k): k for k in full}
    for chunk in model:
        for name, param in chunk_params(chunk, cfg, ctx).items():
            tied = name == MEGATRON_OUTPUT and cfg.tie_embeddings
            source = MEGATRON_EMBEDDING if tied else name
            if source not in names:
                raise ValueError(f"the full state has no {source!r}, which this model chunk needs")
            shard = shard_for_rank(name, full[names[source]], ctx.tp_rank, ctx.dims.tp, cfg)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name}: TP shard has shape {tuple(shard.shape)}, "
                    f"the model parameter {tuple(param.shape)}"
                )
            param.copy_(shard)
