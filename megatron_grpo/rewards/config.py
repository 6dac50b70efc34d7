"""``RewardConfig``: which reward function scores the responses, and how errors are handled."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

RewardType = Literal["math", "exact_match", "format", "remote", "custom"]


@dataclass(kw_only=True)
class RewardConfig:
    """The reward of a response: one main function, plus an optional weighted format term."""

    type: RewardType = "math"
    """Main reward function (each reads only its own parameters below)."""
    case_sensitive: bool = True
    """exact_match: compare case-sensitively."""
    format_pattern: str | None = None
    """Regex for the format reward (type=format, or format_weight != 0); compiled with DOTALL."""
    format_mode: Literal["fullmatch", "search"] = "fullmatch"
    """The whole response must match the pattern, or only some part of it."""
    format_match_score: float = 1.0
    """Format reward of a response that matches."""
    format_miss_score: float = 0.0
    """Format reward of a response that does not match."""
    format_weight: float = 0.0
    """Add format_weight * format reward to the main reward; 0 disables the term."""
    remote_url: str | None = None
    """remote: http(s) URL that is POSTed {"response", "label", "metadata"}."""
    remote_field: str = "reward"
    """remote: key of the reward (a number) in the JSON answer."""
    remote_timeout: float = 30.0
    """remote: seconds to wait for one answer."""
    remote_retries: int = 2
    """remote: extra attempts after a connection error, timeout or 5xx answer."""
    remote_retry_backoff: float = 0.5
    """remote: seconds before the first retry, doubled for each later one."""
    remote_batch_size: int | None = None
    """remote: POST {"batch": [...]} with up to this many samples and read a list of
    rewards from remote_field; None sends one request per sample."""
    custom_function: str | None = None
    """custom: ``package.module:function`` taking (response, label, metadata) -> float."""
    on_error: Literal["fail", "zero"] = "fail"
    """When a reward function raises or returns a non-finite value: stop the run, or score 0."""

    def __post_init__(self) -> None:
        if self.type == "format" or self.format_weight != 0:
            if not self.format_pattern:
                raise ValueError("reward.format_pattern is needed by the format reward")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ValueError(f"reward.format_pattern is not a valid regex: {e}") from None
        if self.type == "format" and self.format_weight != 0:
            raise ValueError("reward.format_weight adds a format term to another reward type")
        if self.type == "remote":
            if not self.remote_url or not self.remote_url.startswith(("http://", "https://")):
                raise ValueError(
                    "reward.type=remote needs an http(s) reward.remote_url, "
                    f"got {self.remote_url!r}"
                )
            if not self.remote_field:
                raise ValueError("reward.remote_field must not be empty")
        if self.remote_timeout <= 0:
            raise ValueError(f"reward.remote_timeout must be > 0, got {self.remote_timeout}")
        if self.remote_retries < 0 or self.remote_retry_backoff < 0:
            raise ValueError(
                "reward.remote_retries and reward.remote_retry_backoff must be >= 0, "
                f"got {self.remote_retries}, {self.remote_retry_backoff}"
            )
        if self.remote_batch_size is not None and self.remote_batch_size < 1:
            raise ValueError(f"reward.remote_batch_size must be >= 1, got {self.remote_batch_size}")
        if self.type == "custom":
            module, sep, name = (self.custom_function or "").partition(":")
            if not (module and sep and name):
                raise ValueError(
                    "reward.type=custom needs reward.custom_function='package.module:function', "
                    f"got {self.custom_function!r}"
                )
