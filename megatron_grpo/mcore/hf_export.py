"""A pipeline stage's weights under Hugging Face names, one decoder layer at a time.

Weight sync streams the policy from every pipeline stage at once: each stage has one
sender, its rank with data-parallel rank 0 and tensor-parallel rank 0. ``stage_hf_layers``
walks the stage's model chunks in order (embedding, layers, final norm, head); for each
decoder layer the TP-split parameters are gathered onto the sender over the tensor-parallel
group, one parameter at a time, joined (``convert.sharding.unshard``) and renamed with the
conversion tools' mapping (``convert.weights``); a MoE layer's experts, split over
expert parallelism (whole experts on each rank), are gathered over the EP group the same
way. The other ranks of the stage's replica 0 take part in the gathers and yield nothing;
ranks of other replicas do not take part.

Memory: besides its own shard, the sender holds one unit's full tensors at a time (a
decoder layer, or the embedding or head): the shards land side by side in one buffer, which
is the joined tensor itself for the layouts split along dim 0 (QKV, vocab); the others and
the HF renaming (split QKV, gate/up) copy a layer's tensors once more. Plus what its
consumer keeps (weight sync: see ``weight_sync.sender``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.config import ModelConfig
from megatron_grpo.convert.experts import expert_index, with_expert_index
from megatron_grpo.convert.sharding import tp_layout, unshard_stacked
from megatron_grpo.convert.weights import (
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_OUTPUT,
    MEGATRON_EMBEDDING,
    MEGATRON_FINAL_NORM,
    MEGATRON_OUTPUT,
    megatron_key_layer,
    megatron_layer_to_hf,
)
from megatron_grpo.mcore.full_state import chunk_params
from megatron_grpo.mcore.offload import require_resident
from megatron_grpo.mcore.parallel import ParallelContext

Unit = tuple[int | None, dict[str, Tensor]]
"""A decoder layer's index (None for the embedding, final norm and head) and its local
parameters under full-model megatron names."""


def is_stage_sender(ctx: ParallelContext) -> bool:
    """Whether this rank sends its pipeline stage's weights."""
    return ctx.dp_rank == 0 and ctx.cp_rank == 0 and ctx.tp_rank == 0


def _expert_dp_rank(ctx: ParallelContext) -> int:
    return dist.get_rank(ctx.pg.expt_dp) if ctx.dims.ep > 1 else 0


def takes_part(ctx: ParallelContext) -> bool:
    """Whether this rank takes part in gathering its stage's weights: the ranks of
    data-parallel replica 0 (the dense weights, over TP) and, with expert parallelism, those
    of expert-data-parallel replica 0 (the experts, over EP)."""
    dense = ctx.dp_rank == 0 and ctx.cp_rank == 0
    return dense or (ctx.dims.ep > 1 and _expert_dp_rank(ctx) == 0)


def stage_units(model: list, cfg: ModelConfig, ctx: ParallelContext) -> list[Unit]:
    """This rank's parameters grouped by decoder layer, in model order; globals first/last."""
    leading: dict[str, Tensor] = {}
    trailing: dict[str, Tensor] = {}
    layers: dict[int, dict[str, Tensor]] = {}
    for chunk in model:
        for name, param in chunk_params(chunk, cfg, ctx).items():
            layer = megatron_key_layer(name)
            if layer is not None:
                layers.setdefault(layer, {})[name] = param
            elif name == MEGATRON_EMBEDDING:
                leading[name] = param
            else:
                trailing[name] = param
    units: list[Unit] = [(None, leading)] if leading else []
    units += [(i, layers[i]) for i in sorted(layers)]
    return units + ([(None, trailing)] if trailing else [])


def _gather_tp(name: str, local: Tensor, cfg: ModelConfig, ctx: ParallelContext) -> Tensor | None:
    """The full tensor on TP rank 0, on the parameter's device (None on the other ranks).
    Collective over the TP group; a replicated or TP=1 parameter is returned as it is."""
    local = local.detach()
    if ctx.dims.tp == 1 or tp_layout(name) == "replicated":
        return local if ctx.tp_rank == 0 else None
    send = local.contiguous()
    stacked = None
    if ctx.tp_rank == 0:  # the shards land side by side: dim-0 layouts need no copy to join
        stacked = send.new_empty(ctx.dims.tp, *send.shape)
    dst = dist.get_global_rank(ctx.tp_group, 0)
    dist.gather(send, None if stacked is None else list(stacked), dst=dst, group=ctx.tp_group)
    if stacked is None:
        return None
    return unshard_stacked(name, stacked, cfg)


def globals_to_hf(full: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF names of whichever of the embedding, final norm and head a stage holds.

    The vocab padding rows are dropped (a view: every padded count holds ``vocab_size``
    rows); with tied embeddings the head (a copy of the embedding on the last stage) is
    not sent.
    """
    out = {}
    for name, tensor in full.items():
        if name == MEGATRON_EMBEDDING:
            out[HF_EMBEDDING] = tensor[: cfg.vocab_size]
        elif name == MEGATRON_FINAL_NORM:
            out[HF_FINAL_NORM] = tensor
        elif name == MEGATRON_OUTPUT:
            if not cfg.tie_embeddings:
                out[HF_OUTPUT] = tensor[: cfg.vocab_size]
        else:
            raise ValueError(f"no Hugging Face name is known for {name!r}")
    return out


def _gather_ep(experts: dict[str, Tensor], ctx: ParallelContext) -> dict[str, Tensor]:
    """Every EP rank's experts of one layer, under their global names, on EP rank 0 ({}
    elsewhere). Collective over the EP group: every rank holds as many experts, alike."""
    dst = dist.get_global_rank(ctx.ep_group, 0)
    local = sorted(experts, key=lambda n: (expert_index(n), n))
    per_rank = len({expert_index(n) for n in local})
    first = min((expert_index(n) or 0 for n in local), default=0)  # ep_rank * per_rank
    out: dict[str, Tensor] = {}
    for name in local:
        send = experts[name].detach().contiguous()
        stacked = send.new_empty(ctx.dims.ep, *send.shape) if ctx.ep_rank == 0 else None
        dist.gather(send, None if stacked is None else list(stacked), dst=dst, group=ctx.ep_group)
        if stacked is not None:
            index = (expert_index(name) or 0) - first
            for r in range(ctx.dims.ep):
                out[with_expert_index(name, r * per_rank + index)] = stacked[r]
    return out


def _split_experts(params: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    experts = {n: t for n, t in params.items() if expert_index(n) is not None}
    return {n: t for n, t in params.items() if n not in experts}, experts


@torch.no_grad()
def stage_hf_layers(model: list, cfg: ModelConfig, ctx: ParallelContext) -> Iterator[dict]:
    """This stage's weights as HF-named tensors, a decoder layer (or the globals) at a time,
    on the stage's sender (``is_stage_sender``); the other ranks that take part
    (``takes_part``) iterate too, joining the TP gathers of the dense weights and the EP
    gathers of the experts, and get nothing. Parameters must be up to date
    (``model.sync_params``) and on the device (``offload.require_resident``)."""
    require_resident(model, "the weight export")
    dense_part = ctx.dp_rank == 0 and ctx.cp_rank == 0
    expert_part = ctx.dims.ep > 1 and _expert_dp_rank(ctx) == 0
    for layer, params in stage_units(model, cfg, ctx):
        dense, experts = _split_experts(params) if ctx.dims.ep > 1 else (params, {})
        full: dict[str, Tensor | None] = {}
        if dense_part:
            full = {name: _gather_tp(name, t, cfg, ctx) for name, t in dense.items()}
        if expert_part and experts:
            full |= _gather_ep(experts, ctx)
        if not is_stage_sender(ctx):
            continue
        joined = {name: t for name, t in full.items() if t is not None}
        if layer is None:
            hf = globals_to_hf(joined, cfg)
        else:
            hf = megatron_layer_to_hf(layer, joined, cfg)
        del full, joined  # what the HF tensors do not view is freed before they are sent
        yield hf
