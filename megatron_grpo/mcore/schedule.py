"""megatron-core's forward/backward schedule, driven with explicit process groups.

``run_schedule`` feeds a list of micro-batches through the (pipelined)
model. Each micro-batch has ``tokens`` [B, S] and ``position_ids`` [B, S] (and, in
THD format, ``cu_seqlens``: megatron-core's ``PackedSeqParams`` for Transformer
Engine's attention); ``loss_fn(micro_batch, logits_BSV)`` runs on the last pipeline
stage and returns ``(loss, num_tokens, metrics)``. The loss is used exactly as
returned: the model config sets ``calculate_per_token_loss`` and replaces the
token-count division (see ``megatron_grpo.algo.loss``), so the gradient is the sum
over micro-batches and DP ranks of d(loss)/d(params).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F

from megatron_grpo.mcore.parallel import ParallelContext


class ModelInput(Protocol):
    """What the model reads from a micro-batch."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int


@dataclass
class TokenBatch:
    """Rows of tokens, each one sequence from position 0, with plain causal attention."""

    tokens: torch.Tensor
    """[B, S] int64."""
    position_ids: torch.Tensor
    """[B, S] int64."""
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    """[m + 1] int32 sequence boundaries of a packed (THD) row; None for plain rows."""
    max_seqlen: int = 0

    @classmethod
    def of(cls, tokens: torch.Tensor) -> TokenBatch:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return cls(tokens, positions.unsqueeze(0).expand_as(tokens))


Batch = TypeVar("Batch", bound=ModelInput)
LossFn = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]


def run_schedule(
    model: list,
    ctx: ParallelContext,
    micro_batches: Sequence[Batch],
    loss_fn: LossFn[Batch],
    *,
    forward_only: bool = False,
    on_forward: Callable[[Batch], None] | None = None,
) -> list[dict]:
    """Run forward (and backward) over ``micro_batches``; return the last stage's metrics.

    On ranks that are not the last pipeline stage the returned list is empty.
    ``on_forward(micro_batch)`` runs on every stage just before the micro-batch's forward
    (the routers' balance loss reads which sequences it holds).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    config = model[0].config
    multiple = ctx.dims.tp if ctx.dims.uses_sequence_parallel else 1

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        tokens, positions, mask = _padded(batch, multiple)
        length = batch.tokens.shape[1]
        if on_forward is not None:
            on_forward(batch)
        packed = _packed_seq_params(batch)
        if packed is None:
            logits = chunk(tokens, positions, mask)
        else:
            logits = chunk(tokens, positions, mask, packed_seq_params=packed)
        return logits, lambda output: loss_fn(batch, output[:, :length])

    num_chunks = len(model)
    iterators: Any = [iter(micro_batches) for _ in range(num_chunks)]
    if num_chunks == 1:
        iterators = iterators[0]
    schedule = get_forward_backward_func(pp_size=ctx.dims.pp, vp_size=ctx.dims.vpp)
    return schedule(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=model if num_chunks > 1 else model[0],
        num_microbatches=len(micro_batches),
        seq_length=max(-(-mb.tokens.shape[1] // multiple) * multiple for mb in micro_batches),
        micro_batch_size=micro_batches[0].tokens.shape[0],
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=ctx.pp_group, config=config),
        pg_collection=ctx.pg,
    )


def _padded(batch: ModelInput, multiple: int):
    """(tokens, position ids, mask) with the sequence padded to ``multiple`` positions:
    sequence parallelism splits it over the TP ranks. Padding at the end changes nothing
    before it under causal attention; a batch with its own mask, or in THD format, must
    come padded."""
    pad = -batch.tokens.shape[1] % multiple
    if not pad:
        return batch.tokens, batch.position_ids, batch.attention_mask
    if batch.attention_mask is not None or batch.cu_seqlens is not None:
        what = "an attention mask" if batch.cu_seqlens is None else "packed (THD) sequences"
        raise ValueError(
            f"a micro-batch of {batch.tokens.shape[1]} positions with {what} must "
            f"be padded to a multiple of TP={multiple} (sequence parallelism) by its maker"
        )
    return F.pad(batch.tokens, (0, pad)), F.pad(batch.position_ids, (0, pad)), None


def _packed_seq_params(batch: ModelInput):
    """megatron-core's ``PackedSeqParams`` for a THD row (None otherwise): the padded
    boundaries of whole sequences, as Transformer Engine's attention and megatron-core's
    RoPE read them, also under context parallelism (they split each sequence themselves)."""
    if batch.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )


def zero_grads(model: list) -> None:
    """Clear the DDP gradient buffers before a new global batch."""
    for chunk in model:
        chunk.zero_grad_buffer()
