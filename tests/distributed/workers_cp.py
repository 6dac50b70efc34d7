"""The loss side of context parallelism on 2 gloo ranks (test_context_parallel.py).

Attention split over CP ranks runs only in Transformer Engine (a GPU); everything after
the logits runs here: each rank takes its CP share of one THD micro-batch and of fixed
logits, sets the loss weights (counted on one CP rank), computes ``grpo_loss`` with the CP
group (the sequence-level terms summed over it) and its gradient. Rank 0 gathers both
shares, puts every position back where it was, and returns them with the loss and the
gradient of the whole micro-batch computed on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB = 100


def _logits(num_positions: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, num_positions, VOCAB, generator=g)


def _with_old_and_ref(mb, seed: int = 6) -> None:
    """Behaviour and reference log-probs near -log V, so ratios spread around 1 and clip."""
    g = torch.Generator().manual_seed(seed)
    base = -torch.log(torch.tensor(float(VOCAB)))
    for name in ("old_logprobs", "ref_logprobs"):
        noise = 0.5 * torch.randn(mb.tokens.shape, generator=g)
        setattr(mb, name, (base + noise) * mb.loss_mask)


def _loss_and_grad(mb, logits: torch.Tensor, cfg, cp_group) -> tuple[float, torch.Tensor, dict]:
    from megatron_grpo.algo.loss import grpo_loss

    leaf = logits.clone().requires_grad_()
    loss, _, metrics = grpo_loss(
        mb, leaf, cfg=cfg, tp_group=None, vocab_size=VOCAB, cp_group=cp_group
    )
    loss.backward()
    assert leaf.grad is not None
    return float(loss), leaf.grad, {k: float(v) for k, v in metrics.items()}


def cp_loss(modes: list[str]) -> dict[str, Any] | None:
    from megatron_grpo.algo.batch import (
        collate_thd,
        context_parallel_indices,
        context_parallel_shard,
    )
    from megatron_grpo.algo.loss import set_loss_weights
    from megatron_grpo.commands.invariance import GROUP_SIZES, MAX_COMPLETION, fixed_batch
    from megatron_grpo.commands.invariance.cases import default_loss
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(cp=2))
    assert ctx.dims.cp == 2 and ctx.dp_size == 1
    samples = fixed_batch(VOCAB)
    full = collate_thd(samples, num_groups=len(GROUP_SIZES), pad_to_multiple=4)
    _with_old_and_ref(full)
    shard = context_parallel_shard(full, 2, ctx.cp_rank)
    index = context_parallel_indices(full.cu_seqlens, 2, ctx.cp_rank)
    logits = _logits(full.tokens.shape[1])
    out: dict[str, Any] = {"modes": {}, "positions": full.tokens.shape[1]}
    for mode in modes:
        cfg = default_loss(mode)
        set_loss_weights(
            [full], cfg, group=None, device=None, count_here=True, max_len=MAX_COMPLETION
        )
        set_loss_weights(
            [shard],
            cfg,
            group=ctx.dp_cp_group,
            device=None,
            count_here=ctx.cp_rank == 0,
            max_len=MAX_COMPLETION,
        )
        ref_loss, ref_grad, ref_metrics = _loss_and_grad(full, logits, cfg, None)
        loss, grad, metrics = _loss_and_grad(shard, logits[:, index], cfg, ctx.cp_group)
        shares: list[Any] = [None, None]
        dist.all_gather_object(shares, (index, loss, grad, metrics, shard.loss_weights))
        whole = torch.zeros_like(ref_grad)
        for idx, _, g, _, _ in shares:
            whole[:, idx] = g
        out["modes"][mode] = {
            "loss": sum(s[1] for s in shares),
            "ref_loss": ref_loss,
            "grad": whole,
            "ref_grad": ref_grad,
            "tokens": sum(s[3]["tokens"] for s in shares),
            "ref_tokens": ref_metrics["tokens"],
            "clipped": sum(s[3]["clipped"] for s in shares),
            "ref_clipped": ref_metrics["clipped"],
            "weights": [s[4] for s in shares],
            "ref_weights": full.loss_weights,
        }
    out["covered"] = sorted(torch.cat([s[0] for s in shares]).tolist())
    return out if ctx.rank == 0 else None
