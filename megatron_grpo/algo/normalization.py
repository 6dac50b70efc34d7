"""Loss normalization: global denominators and per-sequence weights.

Every objective is written J = sum_i sum_t w_i l_{i,t} (docs/loss_normalization.md),
with w_i one of:

    token-mean               1 / T
    seq-mean-token-mean      1 / (N n_i)
    seq-mean-token-sum-norm  1 / (N L)           (Dr. GRPO, L a constant)
    group-token-mean         1 / (P T_g(i))
    group-seq-mean           1 / (P G_g(i) n_i)

n_i is sequence i's number of loss tokens, T = sum n_i, N the number of
sequences, P the number of prompt groups, T_g and G_g the tokens and sequences
of group g. All of them are properties of the GLOBAL batch: they come from
one all-reduce of one small vector over the data-parallel group (DP x CP),
before the micro-batch loop.

Empty things: a sequence with no loss tokens (fully masked: truncated,
filtered, or all tool output) has weight 0 and is not counted in N, G_g or
T_g; a group whose sequences are all empty is not counted in P. So masking a
sequence is the same as leaving it out of the batch. A batch with no loss
tokens at all gives every weight 0 (a zero loss and zero gradient, never NaN).

A mixture-of-experts model adds the routers' load-balancing loss, a second term of J
(``sequence_balance_loss`` with the weight ``aux_loss_weight``): a balance measured per
sequence and averaged over the global batch's sequences, so that, like the policy
loss, it does not depend on how the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.config import check_mode


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of the global batch (float64 so that counts add exactly)."""

    num_tokens: float
    """T: loss tokens in the global batch."""
    num_seqs: float
    """N: sequences with at least one loss token."""
    group_tokens: Tensor
    """T_g, [P_max]: loss tokens per prompt group."""
    group_seqs: Tensor
    """G_g, [P_max]: non-empty sequences per prompt group."""

    @property
    def num_groups(self) -> float:
        """P: groups with at least one loss token."""
        return float((self.group_seqs > 0).sum())

    @classmethod
    def from_vector(cls, vec: Tensor) -> GlobalCounts:
        num_groups = (vec.numel() - 2) // 2
        return cls(
            num_tokens=float(vec[0]),
            num_seqs=float(vec[1]),
            group_tokens=vec[2 : 2 + num_groups],
            group_seqs=vec[2 + num_groups :],
        )


def local_counts(seq_tokens: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """This rank's share of the counts, as one vector [T, N, T_g..., G_g...].

    ``seq_tokens`` [n] holds n_i (whole-sequence loss-token counts) for this
    rank's sequences, ``group_ids`` [n] their prompt group in [0, num_groups).
    """
    if group_ids.numel() and (int(group_ids.min()) < 0 or int(group_ids.max()) >= num_groups):
        raise ValueError(f"group ids must lie in [0, {num_groups}), got {group_ids.tolist()}")
    tokens = seq_tokens.to(torch.float64)
    non_empty = (tokens > 0).to(torch.float64)
    vec = torch.zeros(2 + 2 * num_groups, dtype=torch.float64)
    vec[0] = tokens.sum()
    vec[1] = non_empty.sum()
    vec[2 : 2 + num_groups].index_add_(0, group_ids.long(), tokens)
    vec[2 + num_groups :].index_add_(0, group_ids.long(), non_empty)
    return vec


def global_counts(
    seq_tokens: Tensor,
    group_ids: Tensor,
    num_groups: int,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
    count_here: bool = True,
) -> GlobalCounts:
    """The global denominators: ONE all-reduce over ``group`` (the DP x CP group).

    With context parallelism every CP rank holds a slice of the same
    sequences; only one of them (``count_here``, e.g. cp_rank == 0) adds its
    counts, so each token and sequence is counted exactly once. TP ranks hold
    the same data but are never in the same DP group, so they do not add up.
    ``device`` is where the collective runs: the GPU with nccl (None: the CPU, for gloo).
    """
    vec = local_counts(seq_tokens, group_ids, num_groups)
    if not count_here:
        vec.zero_()
    if group is not None and dist.get_world_size(group) > 1:
        on_device = vec if device is None else vec.to(device)  # nccl reduces GPU tensors only
        dist.all_reduce(on_device, group=group)
        vec = on_device.cpu()
    return GlobalCounts.from_vector(vec)


def sequence_weights(
    mode: str,
    counts: GlobalCounts,
    seq_tokens: Tensor,
    group_ids: Tensor,
    *,
    max_len: int | None = None,
) -> Tensor:
    """w_i for each of this rank's sequences (float64, no NaN, 0 for empty sequences)."""
    check_mode(mode)
    n = seq_tokens.to(torch.float64)
    non_empty = n > 0
    zero = torch.zeros_like(n)

    def safe_inverse(denominator: Tensor) -> Tensor:
        return torch.where(non_empty & (denominator > 0), 1.0 / denominator.clamp(min=1e-300), zero)

    if mode == "token-mean":
        return safe_inverse(torch.full_like(n, counts.num_tokens))
    if mode == "seq-mean-token-mean":
        return safe_inverse(counts.num_seqs * n)
    if mode == "seq-mean-token-sum-norm":
        if max_len is None or max_len <= 0:
            raise ValueError("seq-mean-token-sum-norm (Dr. GRPO) needs a positive max_len L")
        return safe_inverse(torch.full_like(n, counts.num_seqs * max_len))
    g = group_ids.long()
    if mode == "group-token-mean":
        return safe_inverse(counts.num_groups * counts.group_tokens[g])
    return safe_inverse(counts.num_groups * counts.group_seqs[g] * n)  # group-seq-mean


# --------------------------------------------------------------------------- router balance


def aux_loss_weight(coeff: float, num_sequences: int) -> float:
    """v, the weight of each sequence's router balance loss: ``coeff / N`` with N every
    sequence of the GLOBAL batch (masked ones too: their tokens are routed all the same).

    Known on every rank without a collective: a global batch holds
    ``train.global_batch_size`` sequences whatever the layout.
    """
    if num_sequences < 1:
        raise ValueError(f"a global batch needs at least one sequence, got {num_sequences}")
    return coeff / num_sequences


def sequence_balance_loss(
    probs_TE: Tensor,
    seg_T: Tensor,
    routed_SE: Tensor,
    seq_len_S: Tensor,
    weight: float,
    *,
    topk: int,
) -> Tensor:
    """One MoE layer's load-balancing loss over the sequences of a micro-batch:

        v sum_s E sum_i f_si P_si,   f_si = c_si / (k n_s),   P_si = (1/n_s) sum_{t in s} p_ti

    with c_si the tokens of sequence s routed to expert i, n_s its tokens (padding
    excluded), p_ti the router's softmax over all E experts, k the top-k, v
    ``aux_loss_weight``. It is 1 per sequence when the routing is perfectly even; HF's
    Qwen3-MoE loss is k times this. Each sequence is whole in one micro-batch of one rank,
    so the sum over ranks and micro-batches is the same at every layout.

    ``probs_TE`` and ``seg_T`` (sequence index per token, -1 on padding) are this rank's
    tokens; ``routed_SE`` and ``seq_len_S`` count whole sequences. Under sequence
    parallelism each TP rank holds a slice of every sequence and this is its share of
    P: the shares add up over the TP ranks, as their gradients do.
    """
    num_experts = probs_TE.shape[1]
    live = seg_T >= 0
    mass = probs_TE.new_zeros(len(seq_len_S), num_experts)
    mass = mass.index_add(0, seg_T[live], probs_TE[live])  # n_s P_si, this rank's share
    n = seq_len_S.clamp(min=1).to(probs_TE.dtype)
    f = routed_SE.to(probs_TE.dtype) / (topk * n[:, None])
    return weight * num_experts * ((f * mass).sum(dim=1) / n).sum()
