"""Group-relative advantages and dynamic sampling, as pure functions.

A group is the n samples of one prompt. GRPO's advantage of sample i in its
group is r_i minus a baseline (the group mean, or the mean of the others for
leave-one-out), optionally divided by the group's reward std (Dr. GRPO turns
the std scaling off). A group whose rewards are all equal carries no
learning signal: every advantage is 0. Dynamic sampling (DAPO) drops those
groups and samples more prompts until the batch is full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_grpo.config import AdvantageConfig


def group_advantages(rewards_GN: Tensor, cfg: AdvantageConfig) -> Tensor:
    """Advantages [G, n] for rewards [G, n] (G groups of n samples each)."""
    rewards = rewards_GN.double()
    n = rewards.shape[-1]
    if cfg.baseline == "leave_one_out":
        if n < 2:
            raise ValueError("leave-one-out baselines need at least 2 samples per prompt")
        baseline = (rewards.sum(dim=-1, keepdim=True) - rewards) / (n - 1)
    else:
        baseline = rewards.mean(dim=-1, keepdim=True)
    adv = rewards - baseline
    if cfg.scale_by_std:
        std = (
            rewards.std(dim=-1, keepdim=True, unbiased=n > 1)
            if n > 1
            else torch.zeros_like(baseline)
        )
        adv = adv / (std + cfg.std_eps)
    # Exactly zero for groups without spread, whatever the rounding above.
    flat = rewards.max(dim=-1, keepdim=True).values == rewards.min(dim=-1, keepdim=True).values
    return torch.where(flat, torch.zeros_like(adv), adv).to(rewards_GN.dtype)


def has_spread(rewards_GN: Tensor) -> Tensor:
    """[G] bool: groups whose rewards are not all equal (the ones dynamic sampling keeps)."""
    return rewards_GN.max(dim=-1).values > rewards_GN.min(dim=-1).values


@dataclass
class Filled:
    kept: list[int]
    """Indices (into the candidate groups) of the groups kept, in order."""
    num_dropped: int
    """Groups dropped for zero reward spread."""


def fill_batch(spread: Sequence[bool], num_groups: int) -> Filled:
    """Keep the first ``num_groups`` groups with spread, in order."""
    kept = [i for i, ok in enumerate(spread) if ok][:num_groups]
    return Filled(kept=kept, num_dropped=sum(1 for ok in spread if not ok))
