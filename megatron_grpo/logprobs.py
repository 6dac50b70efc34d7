"""Per-token log-probabilities and entropy from vocab-parallel logits.

Each tensor-parallel rank holds a contiguous slice of the (padded) vocabulary
of the logits. The log-softmax is assembled from two TP all-reduces of
per-row scalars (the max; then the sum of exponentials, the target logit and
the entropy's weighted sum together), so the full vocabulary never sits on one
rank. Rows of the embedding beyond the tokenizer's vocabulary (padding added
for TP) are excluded from the softmax, so log-probabilities match the unpadded
model (and the rollout engine).

Log-probability and entropy are one autograd function with a closed-form
backward, like megatron-core's vocab-parallel cross entropy: forward keeps one
float32 buffer, exp(z - max) over the rank's real columns (megatron's keeps the
softmax), and backward turns that buffer into the gradient in place, so the
GRPO loss costs about what a cross-entropy loss does, with no vocabulary-sized
autograd temporaries. With p the softmax, log p_t the target's log-probability and
H = -sum_v p_v log p_v:

    d log p_t / dz_v = 1[v = t] - p_v,        dH / dz_v = -p_v (log p_v + H).

Every TP rank computes the same loss from the reduced values, so each rank's
backward needs only its own slice of the vocabulary and no communication.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _valid_columns(
    local_vocab: int, tp_group: dist.ProcessGroup | None, vocab_size: int
) -> tuple[int, int]:
    """(first vocabulary id of this rank's slice, how many of its columns are real tokens)."""
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = rank * local_vocab
    return start, max(0, min(local_vocab, vocab_size - start))


def _all_reduce(x: Tensor, op: dist.ReduceOp.RedOpType, tp_group: dist.ProcessGroup | None) -> None:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, op=op, group=tp_group)


class _LogprobEntropy(torch.autograd.Function):
    """Log-probs and entropy (``entropy_mode``: "none", "value" or "grad") with their gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        tp_group: dist.ProcessGroup | None,
        vocab_size: int,
        entropy_mode: str,
    ) -> tuple[Tensor, Tensor]:
        start, valid = _valid_columns(logits.shape[-1], tp_group, vocab_size)
        real = logits[..., :valid]  # a view: padding columns never enter the softmax
        row_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        if valid:
            row_max = real.max(dim=-1).values.float()
        _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)

        # One float32 buffer (type promotion makes z - max float32 whatever the logits' dtype).
        shifted = torch.sub(real, row_max.unsqueeze(-1))
        local_ids = targets - start
        in_slice = (local_ids >= 0) & (local_ids < valid)
        stats = torch.zeros((3, *logits.shape[:-1]), dtype=torch.float32, device=logits.device)
        saved = shifted
        if valid:
            picked = shifted.gather(-1, local_ids.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
            stats[1] = torch.where(in_slice, picked, 0.0)
            if entropy_mode == "none":
                saved = exp = shifted.exp_()
            else:
                exp = shifted.exp()
                stats[2] = torch.linalg.vecdot(exp, shifted)
                if entropy_mode == "value":  # no entropy gradient: backward needs only exp
                    saved = exp
            stats[0] = exp.sum(dim=-1)
            del exp, shifted
        # sum of exp, target logit and sum of exp * (z - max), in one all-reduce
        _all_reduce(stats, dist.ReduceOp.SUM, tp_group)

        log_z = stats[0].log()
        logp = stats[1] - log_z
        entropy = log_z - stats[2] / stats[0]
        if entropy_mode != "grad":
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.start, ctx.local_vocab, ctx.dtype = start, logits.shape[-1], logits.dtype
        ctx.saved_log = entropy_mode == "grad"
        ctx.save_for_backward(saved, targets, stats[0], entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None):  # type: ignore[override]
        # The saved buffer is exp(z - max), or z - max when the entropy has a gradient; backward
        # runs once, so that buffer becomes the gradient in place.
        saved, targets, sum_exp, entropy = ctx.saved_tensors
        valid = saved.shape[-1]
        if not valid or (grad_logp is None and grad_entropy is None):
            grad = torch.zeros(
                (*saved.shape[:-1], ctx.local_vocab), dtype=ctx.dtype, device=saved.device
            )
            return grad, None, None, None, None
        g_logp = grad_logp if grad_logp is not None else torch.zeros_like(sum_exp)
        if not ctx.saved_log:  # -p g, with p = exp / sum_exp
            local = saved.mul_((-g_logp / sum_exp).unsqueeze(-1))
        else:
            log_p = saved.sub_(sum_exp.log().unsqueeze(-1))
            p = log_p.exp()
            if grad_entropy is None:
                local = p.mul_(-g_logp.unsqueeze(-1))
            else:  # -p (g + g_H (log p + H))
                coef = (g_logp + grad_entropy * entropy).unsqueeze(-1)
                local = log_p.mul_(-grad_entropy.unsqueeze(-1)).sub_(coef).mul_(p)
        local_ids = targets - ctx.start
        in_slice = (local_ids >= 0) & (local_ids < valid)
        onehot = torch.where(in_slice, g_logp, 0.0).unsqueeze(-1).to(local.dtype)
        local.scatter_add_(-1, local_ids.clamp(0, valid - 1).unsqueeze(-1), onehot)
        if valid < ctx.local_vocab:  # padding columns: zero gradient
            local = torch.nn.functional.pad(local, (0, ctx.local_vocab - valid))
        grad = local.to(ctx.dtype)
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits_BSV: Tensor,
    targets_BS: Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) per position, and optionally the entropy of p, in float32.

    ``logits_BSV`` is this rank's vocabulary slice; ``vocab_size`` is the
    tokenizer's (unpadded) vocabulary size. Targets must be < vocab_size.
    With ``entropy_grad=False`` the entropy is a value only (a metric): it
    carries no gradient, and backward is as cheap as for the log-probs alone.
    """
    mode = ("grad" if entropy_grad else "value") if with_entropy else "none"
    logp, entropy = _LogprobEntropy.apply(logits_BSV, targets_BS, tp_group, vocab_size, mode)
    return logp, (entropy if with_entropy else None)
