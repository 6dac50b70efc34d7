"""Reward functions for GRPO.

A reward function is ``fn(response_text, label, item_metadata) -> float``, or an
``async def`` of the same; a custom one may also be written as TRL's or verl's are
(``reward.custom_style``, adapters.py). ``RewardScorer(RewardConfig(...)).score(responses,
labels, metadatas)`` picks one from the config and scores a batch (async ones
concurrently, sync ones inline or in worker processes), handling failures per
sample.
"""

from megatron_grpo.config import RewardConfig, RewardType
from megatron_grpo.rewards.adapters import TrlReward, VerlReward, adapt, detect_style
from megatron_grpo.rewards.custom import load_function
from megatron_grpo.rewards.math_answer import MathReward, extract_boxed, math_reward
from megatron_grpo.rewards.pool import RewardTimeout, WorkerPool
from megatron_grpo.rewards.remote import RemoteReward, RemoteRewardError
from megatron_grpo.rewards.runner import RewardRunner
from megatron_grpo.rewards.scorer import (
    RewardError,
    RewardFn,
    RewardScorer,
    ScoreResult,
    build_reward_function,
)
from megatron_grpo.rewards.text import FormatReward, exact_match

__all__ = [
    "FormatReward",
    "MathReward",
    "RemoteReward",
    "RemoteRewardError",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RewardRunner",
    "RewardScorer",
    "RewardType",
    "RewardTimeout",
    "ScoreResult",
    "TrlReward",
    "VerlReward",
    "WorkerPool",
    "adapt",
    "build_reward_function",
    "detect_style",
    "exact_match",
    "extract_boxed",
    "load_function",
    "math_reward",
]
