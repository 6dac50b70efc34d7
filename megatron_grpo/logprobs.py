"""Per-token log-probabilities and entropy from vocab-parallel logits.

Each tensor-parallel rank holds a contiguous slice of the (padded) vocabulary
of the logits. The log-softmax is assembled from three TP all-reduces of
per-row scalars (max, sum of exponentials, target logit), so the full
vocabulary never sits on one rank. Rows of the embedding beyond the
tokenizer's vocabulary (padding added for TP) are excluded from the softmax,
so log-probabilities match the unpadded model (and the rollout engine).

The all-reduces use megatron-core's reduce-from-TP-region mapping: a sum in
forward and the identity in backward, which is the right gradient because
every TP rank computes the same loss from the reduced values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _vocab_range(local_vocab: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    return rank * local_vocab, (rank + 1) * local_vocab


def _reduce_sum(x: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=tp_group)


def vocab_parallel_logprobs(
    logits_BSV: Tensor,
    targets_BS: Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) per position, and optionally the entropy of p, in float32.

    ``logits_BSV`` is this rank's vocabulary slice; ``vocab_size`` is the
    tokenizer's (unpadded) vocabulary size. Targets must be < vocab_size.
    """
    logits = logits_BSV.float()
    local_vocab = logits.shape[-1]
    start, end = _vocab_range(local_vocab, tp_group)
    if end > vocab_size:  # this slice holds padding rows: take them out of the softmax
        ids = torch.arange(start, end, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))

    with torch.no_grad():
        row_max = logits.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce_sum(exp.sum(dim=-1), tp_group)

    local_ids = targets_BS - start
    in_slice = (local_ids >= 0) & (local_ids < local_vocab)
    picked = shifted.gather(-1, local_ids.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = _reduce_sum(torch.where(in_slice, picked, torch.zeros_like(picked)), tp_group)
    log_z = sum_exp.log()
    logp = target_shifted - log_z

    entropy = None
    if with_entropy:
        # H = log Z - sum_v p_v * shifted_v ; padding entries have p = 0 (0 * -inf -> nan, so mask).
        weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
        entropy = log_z - _reduce_sum(weighted, tp_group) / sum_exp
    return logp, entropy
