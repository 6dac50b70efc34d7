"""Hand-computed weights for each mode, and the definitions of empty things."""

import pytest
import torch

from megatron_grpo.algo.normalization import (
    GlobalCounts,
    global_counts,
    local_counts,
    sequence_weights,
)
from megatron_grpo.config import MODES

# Three sequences: n = (2, 4, 6) loss tokens; groups (0, 0, 1).
N_I = torch.tensor([2.0, 4.0, 6.0])
GROUPS = torch.tensor([0, 0, 1])


def weights(mode, n=N_I, groups=GROUPS, num_groups=2, max_len=8):
    counts = global_counts(n, groups, num_groups, group=None)
    return sequence_weights(mode, counts, n, groups, max_len=max_len)


def test_counts_vector():
    vec = local_counts(N_I, GROUPS, 2)
    # [T, N, T_0, T_1, G_0, G_1]
    assert vec.tolist() == [12.0, 3.0, 6.0, 6.0, 2.0, 1.0]
    counts = GlobalCounts.from_vector(vec)
    assert counts.num_groups == 2


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", [1 / 12, 1 / 12, 1 / 12]),
        ("seq-mean-token-mean", [1 / (3 * 2), 1 / (3 * 4), 1 / (3 * 6)]),
        ("seq-mean-token-sum-norm", [1 / (3 * 8)] * 3),
        ("group-token-mean", [1 / (2 * 6), 1 / (2 * 6), 1 / (2 * 6)]),
        ("group-seq-mean", [1 / (2 * 2 * 2), 1 / (2 * 2 * 4), 1 / (2 * 1 * 6)]),
    ],
)
def test_hand_computed_weights(mode, expected):
    torch.testing.assert_close(weights(mode), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
def test_objective_is_a_mean_when_every_token_loss_is_one(mode):
    """With l = 1 everywhere, J = sum_i w_i n_i is 1 for every mode but Dr. GRPO."""
    J = float((weights(mode) * N_I.double()).sum())
    expected = float(N_I.mean() / 8) if mode == "seq-mean-token-sum-norm" else 1.0
    assert J == pytest.approx(expected)


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_sequence_counts_as_absent(mode):
    """A fully masked sequence gets weight 0 and leaves the others' weights alone."""
    with_empty = weights(mode, torch.tensor([2.0, 0.0, 4.0, 6.0]), torch.tensor([0, 0, 0, 1]))
    assert with_empty[1] == 0
    torch.testing.assert_close(with_empty[[0, 2, 3]], weights(mode))


@pytest.mark.parametrize("mode", MODES)
def test_empty_group_and_empty_batch_give_no_nan(mode):
    # group 1 holds only an empty sequence: it is not counted in P.
    w = weights(mode, torch.tensor([2.0, 4.0, 0.0]), torch.tensor([0, 0, 1]))
    alone = weights(mode, torch.tensor([2.0, 4.0]), torch.tensor([0, 0]), num_groups=1)
    torch.testing.assert_close(w[:2], alone)
    assert w[2] == 0
    nothing = weights(mode, torch.zeros(3), GROUPS)
    assert torch.equal(nothing, torch.zeros(3, dtype=torch.float64))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'seq-mean'"):
        weights("seq-mean")
    with pytest.raises(ValueError, match=r"needs a positive max_len"):
        weights("seq-mean-token-sum-norm", max_len=None)
    with pytest.raises(ValueError, match=r"group ids must lie in \[0, 2\)"):
        local_counts(N_I, torch.tensor([0, 2, 1]), 2)


def test_length_bias_of_seq_mean_token_mean():
    """Two wrong answers (same negative advantage), one short and one long.

    Under seq-mean-token-mean each token of the long answer is penalized less
    than each token of the short one, so the policy is pushed less away from
    long wrong answers: the length bias. token-mean and Dr. GRPO weigh every
    token alike.
    """
    n = torch.tensor([5.0, 50.0])
    groups = torch.tensor([0, 0])
    per_token = {m: weights(m, n, groups, num_groups=1, max_len=64) for m in MODES}
    assert per_token["seq-mean-token-mean"][1] < per_token["seq-mean-token-mean"][0] / 5
    for mode in ("token-mean", "seq-mean-token-sum-norm", "group-token-mean"):
        assert per_token[mode][0] == per_token[mode][1]
    # Total penalty of each answer: seq-mean-token-mean gives both the same,
    # although the long answer holds ten times as many wrong tokens.
    totals = per_token["seq-mean-token-mean"] * n.double()
    assert totals[0] == pytest.approx(float(totals[1]))


# --------------------------------------------------------------------------- router balance


def test_router_balance_loss_by_hand():
    from megatron_grpo.algo.normalization import aux_loss_weight, sequence_balance_loss

    # 2 experts, top-1. Sequence 0: two tokens, both routed to expert 0:
    #   f = [1, 0], P = [(0.75 + 0.5) / 2, ...] = [0.625, 0.375] -> E f.P = 2 * 0.625 = 1.25.
    # Sequence 1: one token routed to expert 1: f = [0, 1], P = [0.2, 0.8] -> 2 * 0.8 = 1.6.
    # The padding token (-1) counts nowhere.
    probs = torch.tensor([[0.75, 0.25], [0.2, 0.8], [0.5, 0.5], [0.9, 0.1]], requires_grad=True)
    seg = torch.tensor([0, 1, 0, -1])
    routed = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    seq_len = torch.tensor([2, 1])
    v = aux_loss_weight(0.3, 2)
    assert v == pytest.approx(0.15)
    loss = sequence_balance_loss(probs, seg, routed, seq_len, v, topk=1)
    assert float(loss) == pytest.approx(0.15 * (1.25 + 1.6))
    loss.backward()
    # d/dp_ti = v E f_si / n_s: sequence 0 tokens 0.15 * 2 * [1, 0] / 2, sequence 1 [0, 0.3]
    expected = torch.tensor([[0.15, 0.0], [0.0, 0.3], [0.15, 0.0], [0.0, 0.0]])
    assert torch.allclose(probs.grad, expected)


def test_router_balance_loss_adds_up_over_slices_of_a_sequence():
    """Sequence parallelism: each TP rank holds a slice of the tokens; the shares add up."""
    from megatron_grpo.algo.normalization import sequence_balance_loss

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 4, generator=g), dim=-1)
    seg = torch.tensor([0, 0, 1, 1, 1, 0])
    routed = torch.tensor([[2.0, 1, 0, 3], [1, 1, 2, 2]])  # top-2: 2 x tokens each
    seq_len = torch.tensor([3, 3])
    whole = sequence_balance_loss(probs, seg, routed, seq_len, 0.5, topk=2)
    parts = sum(
        sequence_balance_loss(probs[s], seg[s], routed, seq_len, 0.5, topk=2)
        for s in (slice(0, 3), slice(3, 6))
    )
    assert float(parts) == pytest.approx(float(whole))
    assert float(whole) == pytest.approx(
        0.5
        * 4
        * sum(float((routed[s] / (2 * 3) * probs[seg == s].sum(0) / 3).sum()) for s in (0, 1))
    )


def test_aux_loss_weight_refuses_an_empty_batch():
    from megatron_grpo.algo.normalization import aux_loss_weight

    with pytest.raises(ValueError, match="at least one sequence"):
        aux_loss_weight(0.1, 0)
