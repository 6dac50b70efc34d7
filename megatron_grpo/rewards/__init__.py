"""Reward functions for GRPO.

A reward function is ``fn(response_text, label, item_metadata) -> float``.
``RewardScorer(RewardConfig(...)).score(responses, labels, metadatas)`` picks
one from the config and scores a batch, handling failures per sample.
"""

from megatron_grpo.config import RewardConfig, RewardType
from megatron_grpo.rewards.custom import load_function
from megatron_grpo.rewards.math_answer import (
    answers_match,
    extract_answer,
    extract_boxed,
    last_number,
    math_reward,
    parse_number,
)
from megatron_grpo.rewards.remote import RemoteReward, RemoteRewardError
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
    "RemoteReward",
    "RemoteRewardError",
    "RewardConfig",
    "RewardError",
    "RewardFn",
    "RewardScorer",
    "RewardType",
    "ScoreResult",
    "answers_match",
    "build_reward_function",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "last_number",
    "load_function",
    "math_reward",
    "parse_number",
]
