"""The GRPO loss of one micro-batch, and the contract that makes it exact.

The normalization contract, in one place (``scaled_loss``):

    the micro-batch loss is  L_{r,m} = sum_{i in (r,m)} w_i sum_t mask_{i,t} l_{i,t}

with w_i from ``normalization.sequence_weights`` on GLOBAL counts, so that
sum over ranks r and micro-batches m of L_{r,m} is exactly the objective J.
megatron-core must then add no factor of its own, and it does not:
- the model config sets ``calculate_per_token_loss=True``, so the schedule
  does not divide the loss by the number of micro-batches, and DDP sums
  gradients over DP x CP instead of averaging them;
- ``mcore.compat`` hands megatron-core's ``finalize_model_grads`` no token
  count, so the gradients are not divided by it either.
The gradient after the backward passes and the DDP all-reduce is therefore
exactly dJ/dtheta, whatever the layout. KL and entropy use the same weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.algo import policy_loss
from megatron_grpo.algo.batch import MicroBatch
from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
from megatron_grpo.algo.normalization import global_counts, sequence_weights
from megatron_grpo.config import LossConfig

METRIC_SUMS = (
    "tokens",
    "clipped",
    "kl",
    "entropy",
    "is_rejected",
    "rollout_tokens",
    "mismatch",
    "rollout_kl",
)
"""Per-micro-batch sums over loss tokens returned as metrics (divide by "tokens"; those
that compare with the engine's log-probs by "rollout_tokens", the loss tokens that have
them)."""
METRIC_MAXES = ("mismatch_max",)
"""Per-micro-batch maxima over loss tokens returned as metrics."""


def scaled_loss(per_token: Tensor, mask: Tensor, token_weights: Tensor) -> Tensor:
    """sum_i w_i sum_t mask_{i,t} l_{i,t}: the only place a loss is scaled.

    ``token_weights`` holds w_i at every position of sample i (``policy_loss.token_values``).
    """
    return (per_token * mask * token_weights.to(per_token.dtype)).sum()


def set_loss_weights(
    micro_batches: list[MicroBatch],
    cfg: LossConfig,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device | None,
    count_here: bool,
    max_len: int | None = None,
) -> None:
    """Set w_i (``loss_weights``) in every micro-batch of this rank's global-batch share.

    One all-reduce over ``group``, the DP x CP group, before the micro-batch loop
    (``normalization.global_counts``: ``device`` is where it runs, ``count_here``
    whether this rank's counts add in). Run it on the last pipeline stage only:
    only it computes a loss.
    """
    seq_tokens = torch.cat([mb.seq_tokens for mb in micro_batches]).cpu()
    group_ids = torch.cat([mb.group_ids for mb in micro_batches]).cpu()
    counts = global_counts(
        seq_tokens,
        group_ids,
        micro_batches[0].num_groups,
        group=group,
        device=device,
        count_here=count_here,
    )
    weights = sequence_weights(
        cfg.mode, counts, seq_tokens, group_ids, max_len=cfg.max_len or max_len
    )
    for mb, w in zip(micro_batches, weights.split([mb.num_samples for mb in micro_batches])):
        mb.loss_weights = w.to(mb.loss_mask.device)


def grpo_loss(
    batch: MicroBatch,
    logits: Tensor,
    *,
    cfg: LossConfig,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch for megatron-core's schedule: (loss, num_tokens, metric sums).

    Under context parallelism (``cp_group`` of more than one rank) this rank holds part of
    each sequence: its loss is its tokens' share of the sum, and the sequence-level ratio
    and importance weights, which need whole sequences, sum their per-sequence terms over
    the CP group (one all-reduce each, no gradient through it).
    """
    mask, seg = batch.loss_mask, batch.seg
    num_seqs = batch.num_samples
    sequence_sum = _group_sum(cp_group)
    logp, entropy = vocab_parallel_logprobs(
        logits,
        batch.targets,
        tp_group=tp_group,
        vocab_size=vocab_size,
        with_entropy=True,
        entropy_grad=bool(cfg.entropy_coef),
    )
    old_logp = batch.old_logprobs
    if old_logp is None:  # on-policy single pass: the ratio is 1 with the right gradient
        old_logp = logp.detach()
    learner_old = old_logp
    if cfg.old_logprobs == "rollout":
        if batch.rollout_logprobs is None:
            raise ValueError("loss.old_logprobs=rollout needs the samples' rollout log-probs")
        old_logp = batch.rollout_logprobs
    log_ratio = logp - old_logp
    if cfg.ratio_level == "sequence":
        log_ratio = policy_loss.gspo_log_ratio(log_ratio, mask, seg, num_seqs, sequence_sum)
    per_token, clipped = policy_loss.ppo_clip_loss(
        log_ratio,
        batch.advantages,
        eps_low=cfg.eps_clip_low,
        eps_high=cfg.eps_clip_high,
        dual_clip=cfg.dual_clip,
    )
    zeros = torch.zeros_like(mask)
    mismatch, rollout_kl, rejected, rollout_mask = zeros, zeros, zeros, zeros
    rollout_logp = batch.rollout_logprobs
    if rollout_logp is not None:
        rollout_mask = mask
        mismatch = policy_loss.mismatch(learner_old, rollout_logp, mask)
        rollout_kl = policy_loss.rollout_log_ratio(learner_old, rollout_logp, mask)
        if cfg.tis_level is not None:
            is_weights, rejected = policy_loss.importance_weights(
                learner_old,
                rollout_logp,
                mask,
                seg,
                num_seqs,
                level=cfg.tis_level,
                mode=cfg.tis_mode,
                upper=cfg.tis_upper,
                lower=cfg.tis_lower,
                sequence_sum=sequence_sum,
            )
            per_token = per_token * is_weights
    kl = zeros
    if cfg.kl_coef:
        assert batch.ref_logprobs is not None, "loss.kl_coef needs the reference log-probs"
        kl = policy_loss.kl_penalty(logp, batch.ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    assert entropy is not None
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    assert batch.loss_weights is not None, "set_loss_weights runs before the loss"
    loss = scaled_loss(per_token, mask, policy_loss.token_values(batch.loss_weights, seg))
    num_tokens = mask.sum()
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "tokens": num_tokens.detach(),
            "clipped": (clipped * mask).sum(),
            "kl": (kl.detach() * mask).sum(),
            "entropy": (entropy.detach() * mask).sum(),
            "is_rejected": rejected.sum(),
            "rollout_tokens": rollout_mask.sum(),
            "mismatch": mismatch.sum(),
            "rollout_kl": rollout_kl.sum(),
            "mismatch_max": mismatch.max() if mismatch.numel() else zeros.new_zeros(()),
        }
    return loss, num_tokens.to(torch.int), metrics


def _group_sum(group: dist.ProcessGroup | None) -> policy_loss.SequenceSum | None:
    """Sum over ``group`` (a copy, without gradient); None for no group or one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def total(values: Tensor) -> Tensor:
        out = values.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    return total
