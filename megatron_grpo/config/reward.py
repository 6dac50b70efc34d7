"""The ``reward`` section: the main reward function, an optional format term, a remote scorer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class FormatRewardConfig:
    """The format reward: a regex the response must match (``reward.type: format``, or a
    term added to another type's reward with ``weight``)."""

    pattern: str | None = None
    """Regex for the format reward (type=format, or weight != 0); compiled with DOTALL."""
    mode: Literal["fullmatch", "search"] = "fullmatch"
    """The whole response must match the pattern, or only some part of it."""
    match_score: float = 1.0
    """Format reward of a response that matches."""
    miss_score: float = 0.0
    """Format reward of a response that does not match."""
    weight: float = 0.0
    """Add weight * format reward to the main reward; 0 disables the term."""

    def __post_init__(self) -> None:
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward.format.pattern is not a valid regex: {e}") from None


@dataclass(kw_only=True)
class RemoteRewardConfig:
    """The remote reward (``reward.type: remote``): an HTTP service that scores samples."""

    url: str | None = None
    """http(s) URL that is POSTed {"response", "label", "metadata"}."""
    field: str = "reward"
    """Key of the reward (a number) in the JSON answer."""
    timeout_s: float = 30.0
    """Limit for one answer."""
    retries: int = 2
    """Extra attempts after a connection error, timeout or 5xx answer."""
    retry_backoff_s: float = 0.5
    """Wait before the first retry, doubled for each later one."""
    batch_size: int | None = None
    """POST {"batch": [...]} with up to this many samples and read a list of rewards from
    ``field``; None sends one request per sample."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"reward.remote.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ValueError(
                "reward.remote.retries and reward.remote.retry_backoff_s must be >= 0, "
                f"got {self.retries}, {self.retry_backoff_s}"
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"reward.remote.batch_size must be >= 1, got {self.batch_size}")


RewardType = Literal["math", "exact_match", "format", "remote", "custom"]


@dataclass(kw_only=True)
class RewardConfig:
    """The reward of a response: one main function, plus an optional weighted format term."""

    type: RewardType = "math"
    """Main reward function (each reads only its own parameters below)."""
    case_sensitive: bool = True
    """exact_match: compare case-sensitively."""
    custom_function: str | None = None
    """custom: ``package.module:function``, called as custom_style says; an ``async def``
    one is awaited for many samples (or batches) at once (max_concurrency)."""
    custom_pickle: str | None = None
    """custom: instead of custom_function, a file holding the function pickled; what
    ``megatron_grpo.train(reward_fn=...)`` writes (``<output_dir>/reward_fn.pkl``) for a
    function object that other processes cannot import by name. Unpickling runs code: give
    only a file you trust."""
    custom_style: Literal["auto", "native", "trl", "verl"] = "auto"
    """custom: how the function is called. native: ``fn(response, label, metadata) ->
    float`` per sample; trl: TRL's ``fn(prompts, completions, **kwargs) -> list[float]``
    once per batch, the item's columns as keyword arguments; verl: verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float |
    dict`` per sample. auto: by the names of its parameters (native when it has none of
    TRL's or verl's). docs/python_api.md has the arguments of each."""
    label_name: str | None = None
    """custom_style=trl: the keyword argument that carries the item's label; None: the
    label's column, data.label_key."""
    on_error: Literal["fail", "zero"] = "fail"
    """When a reward function raises, runs past timeout_s or returns a non-finite value:
    stop the run, or score 0."""
    math_timeout_s: int = 5
    """math: math-verify's own limit, in whole seconds, on parsing an answer and on each
    comparison; an answer past it counts as wrong (not as an error)."""
    num_workers: int = 0
    """Score with a synchronous reward function (math, exact_match, format, custom) in this
    many worker processes instead of one sample after another in the trainer; a worker
    still busy after timeout_s is killed. The function must be importable by its worker."""
    timeout_s: float = 60.0
    """Limit for one sample's reward in a worker process (num_workers > 0) or of an async
    custom function; past it the sample is a reward error (see on_error)."""
    max_concurrency: int = 64
    """An async custom function (``async def``) is awaited for up to this many samples at
    once; so is the remote reward when it sends one request per sample."""
    cache_size: int = 65536
    """A deterministic reward (math, exact_match, format, or a custom function with the
    attribute ``deterministic = True``) is called once per distinct (response, label,
    metadata); its values are kept for this many distinct ones, across batches (the
    least recently used go first). 0: call it for every sample."""
    format: FormatRewardConfig = field(default_factory=FormatRewardConfig)
    """The format term (and ``type: format``'s reward)."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """``type: remote``'s service."""

    def __post_init__(self) -> None:
        fmt, remote = self.format, self.remote
        if (self.type == "format" or fmt.weight != 0) and not fmt.pattern:
            raise ValueError("reward.format.pattern is needed by the format reward")
        if self.type == "format" and fmt.weight != 0:
            raise ValueError("reward.format.weight adds a format term to another reward type")
        if self.type == "remote":
            if not remote.url or not remote.url.startswith(("http://", "https://")):
                raise ValueError(
                    f"reward.type=remote needs an http(s) reward.remote.url, got {remote.url!r}"
                )
            if not remote.field:
                raise ValueError("reward.remote.field must not be empty")
        if self.math_timeout_s < 1:
            raise ValueError(f"reward.math_timeout_s must be >= 1, got {self.math_timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.cache_size < 0:
            raise ValueError(f"reward.cache_size must be >= 0, got {self.cache_size}")
        if self.timeout_s <= 0 or self.max_concurrency < 1:
            raise ValueError(
                "reward.timeout_s must be > 0 and reward.max_concurrency >= 1, "
                f"got {self.timeout_s}, {self.max_concurrency}"
            )
        if self.label_name == "":
            raise ValueError("reward.label_name must not be empty")
        if self.type == "custom" and self.custom_pickle is not None:
            if self.custom_function is not None:
                raise ValueError("give reward.custom_function or reward.custom_pickle, not both")
        elif self.type == "custom":
            module, sep, name = (self.custom_function or "").partition(":")
            if not (module and sep and name):
                raise ValueError(
                    "reward.type=custom needs reward.custom_function='package.module:function' "
                    f"(or reward.custom_pickle), got {self.custom_function!r}"
                )
