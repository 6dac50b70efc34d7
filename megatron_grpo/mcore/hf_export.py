"""A pipeline stage's weights under Hugging Face names, one decoder layer at a time.

Weight sync streams the policy from every pipeline stage at once: each stage has one
sender, its rank with data-parallel rank 0 and tensor-parallel rank 0. ``stage_hf_layers``
walks the stage's model chunks in order (embedding, layers, final norm, head); for each
decoder layer the TP-split parameters are gathered onto the sender over the tensor-parallel
group, one parameter at a time, joined (``convert.sharding.unshard``) and renamed with the
conversion tools' mapping (``convert.weights``). The other TP ranks of the stage take part
in the gathers and yield nothing; ranks of other data-parallel replicas do not take part.

Memory: besides its own shard, the sender holds one unit's full tensors at a time (a
decoder layer, or the embedding or head): the shards land side by side in one buffer, which
is the joined tensor itself for the layouts split along dim 0 (QKV, vocab); the others and
the HF renaming (split QKV, gate/up) copy a layer's tensors once more. Plus what its
consumer keeps (weight sync: see ``rollout.stage_sender``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.config import ModelConfig
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
from megatron_grpo.mcore.parallel import ParallelContext

Unit = tuple[int | None, dict[str, Tensor]]
"""A decoder layer's index (None for the embedding, final norm and head) and its local
parameters under full-model megatron names."""


def is_stage_sender(ctx: ParallelContext) -> bool:
    """Whether this rank sends its pipeline stage's weights."""
    return ctx.dp_rank == 0 and ctx.cp_rank == 0 and ctx.tp_rank == 0


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


@torch.no_grad()
def stage_hf_layers(model: list, cfg: ModelConfig, ctx: ParallelContext) -> Iterator[dict]:
    """This stage's weights as HF-named tensors, a decoder layer (or the globals) at a time,
    on the stage's TP rank 0; the other TP ranks iterate too (they take part in the gathers)
    and get nothing. Parameters must be up to date (``model.sync_params``)."""
    for layer, params in stage_units(model, cfg, ctx):
        full = {name: _gather_tp(name, t, cfg, ctx) for name, t in params.items()}
        if ctx.tp_rank != 0:
            continue
        joined = {name: t for name, t in full.items() if t is not None}
        if layer is None:
            hf = globals_to_hf(joined, cfg)
        else:
            hf = megatron_layer_to_hf(layer, joined, cfg)
        del full, joined  # what the HF tensors do not view is freed before they are sent
        yield hf
