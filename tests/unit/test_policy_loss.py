"""The per-token policy maths on hand-computed numbers."""

import math

import pytest
import torch

from megatron_grpo.algo.policy_loss import (
    gspo_log_ratio,
    importance_weights,
    kl_penalty,
    mismatch,
    ppo_clip_loss,
)


def test_ppo_clip_with_clip_higher():
    ratio = torch.tensor([0.5, 1.0, 1.25, 1.5, 0.7])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_loss(ratio.log(), adv, eps_low=0.2, eps_high=0.3)
    # A > 0: max(-r, -clip(r, 0.8, 1.3)); A < 0: max(r, clip(r)).
    torch.testing.assert_close(loss, torch.tensor([-0.5, -1.0, -1.25, -1.3, 0.8]))
    assert clipped.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_dual_clip_bounds_negative_advantages():
    ratio = torch.tensor([5.0, 5.0, 2.0])
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, clipped = ppo_clip_loss(ratio.log(), adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2, 2.0]))
    assert clipped.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(ratio.log(), adv, eps_low=0.2, eps_high=0.2, dual_clip=0.5)


def test_gradient_of_unclipped_surrogate_is_minus_advantage():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, _ = ppo_clip_loss(
        logp - logp.detach(), torch.tensor([2.0, -3.0]), eps_low=0.2, eps_high=0.2
    )
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 3.0]))


def test_gspo_sequence_ratio():
    log_ratio = torch.tensor([[0.1, 0.3, 9.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    seg = torch.tensor([[0, 0, 0], [1, 1, -1]])
    seq = gspo_log_ratio(log_ratio, mask, seg, 2)
    torch.testing.assert_close(seq.detach(), torch.tensor([[0.2, 0.2, 0.2], [0.0, 0.0, 0.0]]))
    # two samples packed in one row: each gets its own mean
    packed = gspo_log_ratio(
        torch.tensor([[0.1, 0.3, 1.0, 2.0]]), torch.ones(1, 4), torch.tensor([[0, 0, 1, 1]]), 2
    )
    torch.testing.assert_close(packed, torch.tensor([[0.2, 0.2, 1.5, 1.5]]))
    (seq * mask).sum().backward()  # per-token gradient flows through each token
    torch.testing.assert_close(log_ratio.grad, mask)


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    x = logp - ref  # [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), x)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * x**2)
    expected_k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected_k3)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_truncated_importance_sampling_token_and_sequence():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0 - math.log(3.0), -1.0, -1.0 + math.log(2.0)]])
    mask = torch.ones(1, 3)
    seg = torch.zeros(1, 3, dtype=torch.long)
    w, rejected = importance_weights(
        old, rollout, mask, seg, 1, level="token", mode="truncate", upper=2.0
    )
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5]]))
    assert rejected.tolist() == [[1.0, 0.0, 0.0]]
    w, rejected = importance_weights(
        old, rollout, mask, seg, 1, level="token", mode="mask", upper=2.0, lower=0.6
    )
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]]))
    assert rejected.tolist() == [[1.0, 0.0, 1.0]]
    # Sequence level: the product 3 * 1 * 0.5 = 1.5 for every token.
    w, rejected = importance_weights(
        old, rollout, mask, seg, 1, level="sequence", mode="truncate", upper=2.0
    )
    torch.testing.assert_close(w, torch.full((1, 3), 1.5))
    assert rejected.sum() == 0


def test_mismatch_metric_only_on_loss_tokens():
    got = mismatch(
        torch.tensor([-1.0, -2.0, -3.0]),
        torch.tensor([-1.5, -2.0, -9.0]),
        torch.tensor([1.0, 1.0, 0.0]),
    )
    torch.testing.assert_close(got, torch.tensor([0.5, 0.0, 0.0]))
