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


CPU_CHUNK_BYTES = 2 << 20
"""On CPU the elementwise passes over the vocabulary run a few rows at a time, so that each
row block stays in cache across them (about 2x faster than whole-tensor passes); on GPUs
every row is one block."""


def _row_blocks(x: Tensor) -> list[slice]:
    """Row slices of the 2-D float32 ``x``, one block per pass-group (see CPU_CHUNK_BYTES)."""
    rows, cols = x.shape
    step = rows if x.device.type != "cpu" else CPU_CHUNK_BYTES // (4 * max(cols, 1))
    step = max(step, 1)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _LogprobEntropy(torch.autograd.Function):
    """Log-probs and entropy (``entropy_mode``: "none", "value" or "grad") with their gradient.

    Works on [rows, V] views of one contiguous float32 buffer, z - max, which forward turns
    into exp(z - max) unless the entropy has a gradient (backward then needs z - max).
    """

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

        buf = torch.empty((*logits.shape[:-1], valid), dtype=torch.float32, device=logits.device)
        torch.sub(real, row_max.unsqueeze(-1), out=buf)
        shifted = buf.view(-1, valid)
        local_ids = (targets - start).reshape(-1)
        in_slice = (local_ids >= 0) & (local_ids < valid)
        stats = torch.zeros((3, shifted.shape[0]), dtype=torch.float32, device=logits.device)
        if valid:
            picked = shifted.gather(-1, local_ids.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
            stats[1] = torch.where(in_slice, picked, 0.0)
            for r in _row_blocks(shifted):
                block = shifted[r]
                if entropy_mode == "none":
                    stats[0, r] = block.exp_().sum(dim=-1)
                    continue
                exp = block.exp()
                stats[0, r] = exp.sum(dim=-1)
                stats[2, r] = torch.linalg.vecdot(exp, block)
                if entropy_mode == "value":  # no entropy gradient: backward needs only exp
                    block.copy_(exp)
        # sum of exp, target logit and sum of exp * (z - max), in one all-reduce
        _all_reduce(stats, dist.ReduceOp.SUM, tp_group)

        stats = stats.view(3, *logits.shape[:-1])
        log_z = stats[0].log()
        logp = stats[1] - log_z
        entropy = log_z - stats[2] / stats[0]
        if entropy_mode != "grad":
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.start, ctx.local_vocab, ctx.dtype = start, logits.shape[-1], logits.dtype
        ctx.saved_log = entropy_mode == "grad"
        ctx.save_for_backward(buf, targets, stats[0], entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None):  # type: ignore[override]
        # backward runs once, so the saved buffer becomes the gradient in place
        saved, targets, sum_exp, entropy = ctx.saved_tensors
        valid = saved.shape[-1]
        if not valid or (grad_logp is None and grad_entropy is None):
            grad = torch.zeros(
                (*saved.shape[:-1], ctx.local_vocab), dtype=ctx.dtype, device=saved.device
            )
            return grad, None, None, None, None
        g_logp = grad_logp if grad_logp is not None else torch.zeros_like(sum_exp)
        local = saved.view(-1, valid)
        g = g_logp.reshape(-1, 1)
        if not ctx.saved_log:  # -p g, with p = exp / sum_exp: one pass
            local.mul_(-g / sum_exp.reshape(-1, 1))
        else:
            log_z = sum_exp.log().reshape(-1, 1)
            g_h = grad_entropy.reshape(-1, 1) if grad_entropy is not None else None
            coef = g if g_h is None else g + g_h * entropy.reshape(-1, 1)
            for r in _row_blocks(local):
                log_p = local[r].sub_(log_z[r])
                if g_h is None:  # -p g
                    log_p.exp_().mul_(-g[r])
                else:  # -p (g + g_H (log p + H))
                    p = log_p.exp()
                    log_p.mul_(-g_h[r]).sub_(coef[r]).mul_(p)
        local_ids = (targets - ctx.start).reshape(-1)
        in_slice = (local_ids >= 0) & (local_ids < valid)
        onehot = torch.where(in_slice, g_logp.reshape(-1), 0.0).unsqueeze(-1).to(local.dtype)
        local.scatter_add_(-1, local_ids.clamp(0, valid - 1).unsqueeze(-1), onehot)
        grad = saved
        if valid < ctx.local_vocab:  # padding columns: zero gradient
            grad = torch.nn.functional.pad(saved, (0, ctx.local_vocab - valid))
        return grad.to(ctx.dtype), None, None, None, None


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
