"""The GRPO loss of one micro-batch, and the contract that makes it exact.

The normalization contract, in one place (``scaled_loss``):

    the micro-batch loss is  L_{r,m} = sum_{i in (r,m)} w_i sum_t mask_{i,t} l_{i,t}

with w_i from ``normalization.sequence_weights`` on GLOBAL counts, so that
sum over ranks r and micro-batches m of L_{r,m} is exactly the objective J.
megatron-core must then add no factor of its own, and it does not:
- the model config sets ``calculate_per_token_loss=True``, so the schedule
  does not divide the loss by the number of micro-batches, and DDP sums
  gradients over DP x CP instead of averaging them;
- ``model._finalize_grads`` calls ``finalize_model_grads`` without the token
  count, so the gradients are not divided by it either.
The gradient after the backward passes and the DDP all-reduce is therefore
exactly dJ/dtheta, whatever the layout. KL and entropy use the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.algo import policy_loss
from megatron_grpo.algo.batch import token_values
from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
from megatron_grpo.algo.normalization import global_counts, sequence_weights
from megatron_grpo.config import LossConfig
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.schedule import run_schedule

METRIC_SUMS = ("tokens", "clipped", "kl", "entropy", "mismatch", "is_rejected")
"""Per-micro-batch sums over loss tokens returned as metrics (divide by "tokens")."""


def scaled_loss(per_token: Tensor, mask: Tensor, token_weights: Tensor) -> Tensor:
    """sum_i w_i sum_t mask_{i,t} l_{i,t}: the only place a loss is scaled.

    ``token_weights`` holds w_i at every position of sample i (``batch.token_values``).
    """
    return (per_token * mask * token_weights.to(per_token.dtype)).sum()


def set_loss_weights(
    micro_batches: list[dict[str, Any]],
    cfg: LossConfig,
    ctx: ParallelContext,
    *,
    num_groups: int,
    max_len: int | None = None,
) -> None:
    """Attach w_i ("loss_weights") to every micro-batch of this rank's global-batch share.

    One all-reduce over the DP x CP group, before the micro-batch loop. Only
    the last pipeline stage computes a loss, so only it takes part.
    """
    if not ctx.is_last_stage:
        return
    seq_tokens = torch.cat([mb["seq_tokens"] for mb in micro_batches]).cpu()
    group_ids = torch.cat([mb["group_ids"] for mb in micro_batches]).cpu()
    counts = global_counts(
        seq_tokens, group_ids, num_groups, group=ctx.dp_cp_group, count_here=ctx.cp_rank == 0
    )
    weights = sequence_weights(
        cfg.mode, counts, seq_tokens, group_ids, max_len=cfg.max_len or max_len
    )
    for mb, w in zip(micro_batches, weights.split([len(mb["seq_tokens"]) for mb in micro_batches])):
        mb["loss_weights"] = w.to(mb["loss_mask"].device)


def grpo_loss(
    batch: dict[str, Any],
    logits: Tensor,
    *,
    cfg: LossConfig,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch for megatron-core's schedule: (loss, num_tokens, metric sums)."""
    mask, seg = batch["loss_mask"], batch["seg"]
    num_seqs = len(batch["seq_tokens"])
    logp, entropy = vocab_parallel_logprobs(
        logits,
        batch["targets"],
        tp_group=tp_group,
        vocab_size=vocab_size,
        with_entropy=True,
        entropy_grad=bool(cfg.entropy_coef),
    )
    old_logp = batch.get("old_logprobs")
    if old_logp is None:  # on-policy single pass: the ratio is 1 with the right gradient
        old_logp = logp.detach()
    log_ratio = logp - old_logp
    if cfg.ratio_level == "sequence":
        log_ratio = policy_loss.gspo_log_ratio(log_ratio, mask, seg, num_seqs)
    per_token, clipped = policy_loss.ppo_clip_loss(
        log_ratio,
        batch["advantages"],
        eps_low=cfg.eps_clip_low,
        eps_high=cfg.eps_clip_high,
        dual_clip=cfg.dual_clip,
    )
    zeros = torch.zeros_like(mask)
    mismatch, rejected = zeros, zeros
    rollout_logp = batch.get("rollout_logprobs")
    if rollout_logp is not None:
        mismatch = policy_loss.mismatch(old_logp, rollout_logp, mask)
        if cfg.tis_level is not None:
            is_weights, rejected = policy_loss.importance_weights(
                old_logp,
                rollout_logp,
                mask,
                seg,
                num_seqs,
                level=cfg.tis_level,
                mode=cfg.tis_mode,
                upper=cfg.tis_upper,
                lower=cfg.tis_lower,
            )
            per_token = per_token * is_weights
    kl = zeros
    if cfg.kl_coef:
        kl = policy_loss.kl_penalty(logp, batch["ref_logprobs"], cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    assert entropy is not None
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    loss = scaled_loss(per_token, mask, token_values(batch["loss_weights"], seg))
    num_tokens = mask.sum()
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "tokens": num_tokens.detach(),
            "clipped": (clipped * mask).sum(),
            "kl": (kl.detach() * mask).sum(),
            "entropy": (entropy.detach() * mask).sum(),
            "mismatch": mismatch.sum(),
            "is_rejected": rejected.sum(),
        }
    return loss, num_tokens.to(torch.int), metrics


def compute_logprobs(
    model: list,
    ctx: ParallelContext,
    micro_batches: list[dict[str, Any]],
    *,
    vocab_size: int,
    key: str = "old_logprobs",
) -> None:
    """Forward-only pass storing per-token log-probs in each micro-batch under ``key``.

    Only the last pipeline stage ends up holding them, which is where the
    loss needs them.
    """

    def store(batch: dict[str, Any], logits: Tensor):
        logp, _ = vocab_parallel_logprobs(
            logits, batch["targets"], tp_group=ctx.tp_group, vocab_size=vocab_size
        )
        batch[key] = logp.detach() * batch["loss_mask"]
        return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

    with torch.no_grad():
        run_schedule(model, ctx, micro_batches, store, forward_only=True)
