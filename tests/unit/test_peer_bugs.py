"""Regression tests for normalization bugs that peer trainers shipped (shared PEER_BUGS.md).

Bugs that only show across processes are covered by the distributed tests:
per-micro-batch / per-device denominators (verl#5625/#5626/#5641/#7321/#906,
open-instruct#1161, prime-rl#583/#2359, TRL#3231/#2881), stray DP or
micro-batch factors (slime#987, NeMo-RL#1693, AReaL#1273,
NeMo-Automodel#3830) and a grad norm scaled by the micro-batch count
(NeMo-RL#1426) by tests/distributed/test_loss_invariance.py (gradients,
updates and grad norms across layouts, micro-batch counts and a permutation,
plus planted-bug controls); an all-reduce over the world instead of DP by
tests/distributed/test_loss_collectives.py.
"""

import pytest
import torch

from megatron_grpo.algo.batch import Sample, collate
from megatron_grpo.algo.loss import scaled_loss
from megatron_grpo.algo.normalization import (
    GlobalCounts,
    global_counts,
    local_counts,
    sequence_weights,
)
from megatron_grpo.config import MODES


def weights_of(mode, n, groups, num_groups, max_len=16):
    counts = global_counts(n, groups, num_groups, group=None)
    return sequence_weights(mode, counts, n, groups, max_len=max_len)


def test_tool_output_is_not_counted_trl_6439_slime_365():
    """Denominators come from the loss mask, not the response length."""
    prompt, response = [1, 2, 3], [4, 5, 6, 7, 8, 9]
    mask = [0, 0, 0] + [1, 0, 0, 0, 1, 1]  # three tokens of tool output inside the response
    s = Sample(
        tokens=torch.tensor(prompt + response),
        loss_mask=torch.tensor(mask, dtype=torch.float),
        advantage=1.0,
        group=0,
        sample_id=0,
    )
    assert collate([[s]], num_groups=1).seq_tokens.tolist() == [3.0]
    assert local_counts(collate([[s]], num_groups=1).seq_tokens, torch.tensor([0]), 1)[0] == 3


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_samples_do_not_inflate_denominators_miles(mode):
    n, g = torch.tensor([3.0, 5.0]), torch.tensor([0, 1])
    padded = weights_of(mode, torch.tensor([3.0, 0.0, 0.0, 5.0]), torch.tensor([0, 0, 1, 1]), 2)
    torch.testing.assert_close(padded[[0, 3]], weights_of(mode, n, g, 2))


def test_dr_grpo_keeps_one_over_n_verl_5366():
    """Doubling the batch (each sequence twice) must not double the objective."""
    n, g = torch.tensor([3.0, 5.0]), torch.tensor([0, 0])
    w1 = weights_of("seq-mean-token-sum-norm", n, g, 1)
    w2 = weights_of("seq-mean-token-sum-norm", n.repeat(2), g.repeat(2), 1)
    assert float((w1 * n).sum()) == pytest.approx(float((w2 * n.repeat(2)).sum()))
    assert float(w1[0]) == pytest.approx(1 / (2 * 16))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [[8], [4, 4], [1, 2, 5], [3, 3, 2]])
def test_weights_depend_only_on_the_global_batch_trl_6024(mode, splits):
    """However the global batch is cut (accumulation steps, generation batches, ranks),
    the weights come from counts that add up to the same vector."""
    n = torch.tensor([4.0, 0.0, 7.0, 1.0, 9.0, 2.0, 2.0, 5.0])
    g = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    vec = sum(local_counts(a, b, 4) for a, b in zip(n.split(splits), g.split(splits)))
    w = sequence_weights(mode, GlobalCounts.from_vector(vec), n, g, max_len=16)
    torch.testing.assert_close(w, weights_of(mode, n, g, 4))


def test_context_parallel_counts_each_token_once_prime_rl_2562_slime_990():
    """Two CP ranks hold slices of the same sequences: their all-reduced counts equal one copy's."""
    n, g = torch.tensor([6.0, 2.0]), torch.tensor([0, 1])
    per_cp_rank = [global_counts(n, g, 2, group=None, count_here=r == 0) for r in (0, 1)]
    assert sum(c.num_tokens for c in per_cp_rank) == 8
    assert sum(c.num_seqs for c in per_cp_rank) == 2


def test_side_losses_use_the_policy_weights_megatron_1532():
    """KL (or any side loss) added per token is aggregated with the same w_i."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    pg = torch.tensor([[0.5, -0.5, 9.0], [1.0, 2.0, 3.0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 0.4, 0.5]])
    w = torch.tensor([[0.2], [0.1]], dtype=torch.float64).expand(2, 3)
    both = scaled_loss(pg + 0.5 * kl, mask, w)
    assert float(both) == pytest.approx(
        float(scaled_loss(pg, mask, w) + 0.5 * scaled_loss(kl, mask, w))
    )
    assert float(scaled_loss(kl, mask, w)) == pytest.approx(0.2 * 0.3 + 0.1 * 1.2)


def test_dapo_per_prompt_formula_is_group_token_mean_verl_2776():
    """The DAPO paper's 1/sum|o_i| per prompt, averaged over prompts, is not the token mean."""
    n, g = torch.tensor([2.0, 2.0, 10.0]), torch.tensor([0, 0, 1])
    group = weights_of("group-token-mean", n, g, 2)
    token = weights_of("token-mean", n, g, 2)
    torch.testing.assert_close(group, torch.tensor([1 / 8, 1 / 8, 1 / 20], dtype=torch.float64))
    torch.testing.assert_close(token, torch.full((3,), 1 / 14, dtype=torch.float64))
