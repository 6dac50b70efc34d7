"""Per-token policy-gradient maths as small pure functions.

Every function here works on per-token tensors of one shape ([B, S] in
practice) and returns per-token values; none of them aggregates over tokens
or sequences. Aggregation, with the global weights of the chosen
normalization mode, is ``megatron_grpo.algo.normalization``'s job.

Conventions: ``logp`` is the current policy's log-probability of the sampled
token, ``old_logp`` the behaviour policy's as computed by the trainer before
the optimizer passes, ``rollout_logp`` the rollout engine's, ``ref_logp`` the
reference model's. A ``mask`` is 1.0 on loss tokens and 0.0 elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

SequenceSum = Callable[[Tensor], Tensor]
"""Completes per-sequence sums [k, n] whose terms are spread over ranks: under context
parallelism each CP rank holds part of every sequence, and this sums over the CP group
(``algo.loss``); None when every rank holds whole sequences."""


def ppo_clip_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, per token, with clip-higher and optional dual clip.

    loss = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and for A < 0 with
    dual clip c > 1: min(loss, -A c). Returns (loss, clipped) where ``clipped``
    is 1.0 where a clip bound was active.
    """
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    was_clipped = clipped_loss > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        lower = -advantages * dual_clip
        dual = (advantages < 0) & (loss > lower)
        loss = torch.where(dual, lower, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.to(loss.dtype)


def segment_sum(values: Tensor, seg: Tensor, num_segments: int) -> Tensor:
    """Sum [B, S] values per sample: seg maps positions to sample index, -1 = padding."""
    keep = seg >= 0
    out = values.new_zeros(num_segments)
    return out.index_add(0, seg[keep], values[keep])


def token_values(per_seq: Tensor, seg: Tensor) -> Tensor:
    """Broadcast a per-sample vector [n] onto positions [B, S] (0 on padding)."""
    if not per_seq.numel():  # an idle micro-batch: padding only
        return per_seq.new_zeros(seg.shape)
    out = per_seq[seg.clamp(min=0)]
    return torch.where(seg >= 0, out, torch.zeros_like(out))


def gspo_log_ratio(
    log_ratio: Tensor,
    mask: Tensor,
    seg: Tensor,
    num_seqs: int,
    sequence_sum: SequenceSum | None = None,
) -> Tensor:
    """GSPO's sequence-level log-ratio, broadcast to tokens with a per-token gradient.

    s_i = mean over sample i's loss tokens of (logp - old_logp); every token
    of sample i gets the value s_i, and its gradient flows through each
    token's logp as in GSPO-token: sg(s_i) + log_ratio_t - sg(log_ratio_t).
    Samples without loss tokens get 0.
    """
    sums = torch.stack(
        [segment_sum((log_ratio * mask).detach(), seg, num_seqs), segment_sum(mask, seg, num_seqs)]
    )
    if sequence_sum is not None:
        sums = sequence_sum(sums)
    seq = sums[0] / sums[1].clamp(min=1)
    per_token = token_values(seq, seg)
    return per_token + log_ratio - log_ratio.detach()


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(-x) - 1 + x >= 0: unbiased and low-variance.
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def importance_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    seg: Tensor,
    num_seqs: int,
    *,
    level: Literal["token", "sequence"],
    mode: Literal["truncate", "mask"],
    upper: float,
    lower: float | None = None,
    sequence_sum: SequenceSum | None = None,
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights pi_old / pi_rollout correcting the engine mismatch.

    Token level uses each token's ratio; sequence level uses the product over
    the sample's loss tokens (one weight per sample, broadcast via ``seg``). "truncate"
    caps the weight at ``upper`` (TIS); "mask" zeroes tokens whose weight lies
    outside [lower, upper]. Returns (weights, rejected) where ``rejected`` is
    1.0 on loss tokens that were truncated or masked. Weights carry no gradient.
    """
    if upper <= 0 or (lower is not None and not 0 <= lower < upper):
        raise ValueError(
            f"importance-sampling bounds must satisfy 0 <= lower < upper, got {lower}, {upper}"
        )
    log_w = (old_logp - rollout_logp).detach() * mask
    if level == "sequence":
        per_seq = segment_sum(log_w, seg, num_seqs)
        if sequence_sum is not None:
            per_seq = sequence_sum(per_seq[None])[0]
        log_w = token_values(per_seq, seg)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}")
    w = log_w.exp()
    low = 0.0 if lower is None else lower
    if mode == "truncate":
        rejected = w > upper
        w = w.clamp(max=upper)
    elif mode == "mask":
        rejected = (w > upper) | (w < low)
        w = torch.where(rejected, torch.zeros_like(w), w)
    else:
        raise ValueError(f"unknown importance-sampling mode {mode!r}")
    return w * mask, rejected.to(w.dtype) * mask


def mismatch(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor) -> Tensor:
    """Per-token |logp_train - logp_rollout| on loss tokens (a metric, no gradient)."""
    return (logp_train.detach() - logp_rollout).abs() * mask


def rollout_log_ratio(logp_train: Tensor, logp_rollout: Tensor, mask: Tensor) -> Tensor:
    """Per-token logp_rollout - logp_train on loss tokens (a metric, no gradient): on the
    engine's samples its mean is the k1 estimate of KL(engine || learner)."""
    return (logp_rollout - logp_train.detach()) * mask
