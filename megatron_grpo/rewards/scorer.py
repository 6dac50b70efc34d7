"""``RewardScorer``: a batch of responses in, one finite reward per response out.

The main function is a built-in one or a custom one called in its style (native, TRL's
or verl's: rewards/adapters.py), and runs as rewards/runner.py says: an async one
concurrently, a sync one inline or in worker processes (``reward.num_workers``), a
TRL-style one once per batch. A reward function that raises, runs past
``reward.timeout_s``, or returns something that is not a finite number, is an error of
that sample. ``on_error="fail"``: the first error stops the batch (the samples still
running are abandoned: tasks cancelled, worker processes killed) and is raised as a
``RewardError`` that names the reward, the sample and the cause. ``on_error="zero"``: the
sample scores 0.0 and is counted, and a batch's errors are logged as one line (how many,
and the first).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_grpo.config import RewardConfig
from megatron_grpo.rewards.adapters import (
    COMPLETION_IDS_KEY,
    PROMPT_KEY,
    TrlReward,
    VerlReward,
    adapt,
)
from megatron_grpo.rewards.custom import IN_PROCESS, load_function, load_pickled
from megatron_grpo.rewards.math_answer import MathReward
from megatron_grpo.rewards.memo import RewardMemo, is_deterministic
from megatron_grpo.rewards.pool import RewardCancelled
from megatron_grpo.rewards.remote import RemoteReward
from megatron_grpo.rewards.runner import RewardRunner, is_async
from megatron_grpo.rewards.text import FormatReward, exact_match

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Any, dict[str, Any]], float | Awaitable[float]]
"""``(response_text, label, item_metadata) -> reward``, or an async function of the same."""

RESPONSE_PREFIX = 100
"""Characters of a response that an error message or warning shows."""


class RewardError(RuntimeError):
    """A reward function failed on one sample (raised with ``on_error="fail"``)."""

    def __init__(
        self,
        index: int,
        cause: Exception,
        *,
        reward: str = "function",
        response: str | None = None,
    ) -> None:
        """``reward``: which one (``RewardScorer.name``); ``response``: the sample's text."""
        self.index = index
        self.cause = cause
        self.reward = reward
        self.response = response
        shown = "" if response is None else f" (response {response[:RESPONSE_PREFIX]!r})"
        super().__init__(
            f"reward {reward} failed on sample {index}{shown}: {type(cause).__name__}: {cause}"
        )


@dataclass(frozen=True)
class ScoreResult:
    rewards: list[float]
    num_errors: int
    """Samples whose reward function failed (scored 0.0)."""
    errors: list[str]
    """One ``sample <i>: <exception>`` line per failed sample."""


def format_reward(config: RewardConfig) -> FormatReward:
    fmt = config.format
    assert fmt.pattern is not None  # RewardConfig checks this
    return FormatReward(
        fmt.pattern, mode=fmt.mode, match_score=fmt.match_score, miss_score=fmt.miss_score
    )


def build_reward_function(config: RewardConfig, *, label_key: str = "label") -> RewardFn:
    """The main reward function of a config (imports a custom one: may raise ValueError);
    ``label_key``: the label's column (data.label_key), which a TRL-style function gets it
    under unless reward.label_name says otherwise."""
    # Module-level callables only: a worker process receives the function pickled.
    if config.type == "math":
        return MathReward(timeout_s=config.math_timeout_s)
    if config.type == "exact_match":
        return functools.partial(exact_match, case_sensitive=config.case_sensitive)
    if config.type == "format":
        return format_reward(config)
    if config.type == "remote":
        remote = config.remote
        assert remote.url is not None  # RewardConfig checks this
        return RemoteReward(
            remote.url,
            field=remote.field,
            timeout=remote.timeout_s,
            retries=remote.retries,
            backoff=remote.retry_backoff_s,
        )
    assert config.type == "custom"
    if config.custom_pickle is not None:
        fn = load_pickled(config.custom_pickle)
    else:
        assert config.custom_function is not None  # RewardConfig checks this
        fn = load_function(config.custom_function)
    return adapt(fn, config.custom_style, label_name=config.label_name or label_key)


def reward_name(config: RewardConfig) -> str:
    """The reward as errors and warnings name it: its type, and what it calls."""
    if config.type == "custom":
        spec = config.custom_function or f"pickled in {config.custom_pickle}"
        if spec.startswith(IN_PROCESS):
            spec = f"function object {spec[len(IN_PROCESS) :]}"
        return f"custom {spec}"
    if config.type == "remote":
        return f"remote {config.remote.url}"
    return config.type


def as_reward(value: object) -> float:
    """A reward function's return value as a finite float, or an error saying what it was."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__} {value!r:.100}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned non-finite {reward}")
    return reward


def _failed(value: object) -> bool:
    """A main function's result that is an error of its sample."""
    try:
        as_reward(value)
    except Exception:
        return True
    return False


def _with_context(
    metadatas: Sequence[dict[str, Any]],
    prompts: Sequence[Any] | None,
    completion_ids: Sequence[Sequence[int]] | None,
) -> list[dict[str, Any]]:
    """Each sample's metadata with its prompt and completion ids, for a TRL-style function
    (they travel with it through the memo and to worker processes)."""
    out = []
    for i, meta in enumerate(metadatas):
        extra: dict[str, Any] = {}
        if prompts is not None:
            extra[PROMPT_KEY] = prompts[i]
        if completion_ids is not None:
            extra[COMPLETION_IDS_KEY] = list(completion_ids[i])
        out.append({**meta, **extra})
    return out


class RewardScorer:
    """Scores batches of responses as a ``RewardConfig`` says."""

    def __init__(self, config: RewardConfig, *, label_key: str = "label") -> None:
        """``label_key``: the column the labels come from (data.label_key)."""
        self.config = config
        self.reward_fn = build_reward_function(config, label_key=label_key)
        self.name = reward_name(config)
        if isinstance(self.reward_fn, TrlReward | VerlReward):
            self.name += f" ({self.reward_fn.style}-style)"
        self.format_fn = format_reward(config) if config.format.weight != 0 else None
        remote = isinstance(self.reward_fn, RemoteReward)
        self.runner = RewardRunner(
            self.reward_fn.score_async
            if isinstance(self.reward_fn, RemoteReward)
            else self.reward_fn,
            max_concurrency=config.max_concurrency,
            num_workers=config.num_workers,
            timeout_s=None if remote else config.timeout_s,  # a remote reward has its own
        )
        self.memo = (
            RewardMemo(config.cache_size)
            if config.cache_size and is_deterministic(self.reward_fn)
            else None
        )

    @property
    def runs_elsewhere(self) -> bool:
        """The main function runs outside this thread (worker processes, an async function
        on a loop of its own, a remote server): scoring may go on beside other work."""
        return self.runner.pool is not None or is_async(self.runner.fn)

    def _main_values(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict[str, Any]],
    ) -> list[object]:
        """The main function's value for each sample, or the exception it raised; with
        ``on_error="fail"``, a ``RewardCancelled`` for each sample left after a failure."""
        stop_if = _failed if self.config.on_error == "fail" else None
        batch_size = self.config.remote.batch_size
        if isinstance(self.reward_fn, RemoteReward) and batch_size:
            values: list[object] = []
            for start in range(0, len(responses), batch_size):
                part = slice(start, start + batch_size)
                try:
                    values += self.reward_fn.score_batch(
                        responses[part], labels[part], metadatas[part]
                    )
                except Exception as e:  # a failed request fails each of its samples
                    values += [e] * len(responses[part])
                if stop_if is not None and any(stop_if(v) for v in values[part]):
                    return values + [RewardCancelled() for _ in responses[len(values) :]]
            return values
        jobs = list(zip(responses, labels, metadatas, strict=True))
        run = functools.partial(self.runner.run, stop_if=stop_if)
        if self.memo is not None:
            return self.memo.run(jobs, run)
        return run(jobs)

    def _total(self, response: str, value: object) -> float:
        if isinstance(value, Exception):
            raise value
        reward = as_reward(value)
        if self.format_fn is not None:
            reward += self.config.format.weight * self.format_fn(response)
        return reward

    def score(
        self,
        responses: Sequence[str],
        labels: Sequence[Any],
        metadatas: Sequence[dict[str, Any]],
        *,
        prompts: Sequence[Any] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        warn: bool = True,
    ) -> ScoreResult:
        """``prompts``, ``completion_ids``: each sample's prompt and generated token ids,
        which a TRL-style function gets as ``prompts`` and ``completion_ids`` (None
        without them); the other styles do not read them. ``warn``: log the batch's errors
        (``on_error="zero"``) as one line; False for a caller that scores a batch in parts
        and logs their errors together."""
        counts = {"responses": len(responses), "labels": len(labels), "metadatas": len(metadatas)}
        for name, given in (("prompts", prompts), ("completion ids", completion_ids)):
            if given is not None:
                counts[name] = len(given)
        if len(set(counts.values())) != 1:
            raise ValueError(
                "score() needs one label and one metadata (and prompt and completion ids, when "
                "given) per response, got " + ", ".join(f"{n} {k}" for k, n in counts.items())
            )
        if isinstance(self.reward_fn, TrlReward) and (prompts, completion_ids) != (None, None):
            metadatas = _with_context(metadatas, prompts, completion_ids)
        values = self._main_values(responses, labels, metadatas)
        rewards: list[float] = []
        failed: list[tuple[int, Exception]] = []
        for index, (response, value) in enumerate(zip(responses, values, strict=True)):
            try:
                rewards.append(self._total(response, value))
                continue
            except RewardCancelled:  # another sample failed, and is raised below
                assert self.config.on_error == "fail"
            except Exception as e:
                if self.config.on_error == "fail":
                    raise RewardError(index, e, reward=self.name, response=response) from e
                failed.append((index, e))
            rewards.append(0.0)
        errors = [f"sample {i}: {type(e).__name__}: {e}" for i, e in failed]
        if failed and warn:
            first, cause = failed[0]
            kinds = Counter(type(e).__name__ for _, e in failed)
            logger.warning(
                "reward %s: %d of %d samples failed (%s), scored 0; first: sample %d "
                "(response %r): %s: %s",
                self.name,
                len(failed),
                len(responses),
                ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()),
                first,
                responses[first][:RESPONSE_PREFIX],
                type(cause).__name__,
                cause,
            )
        return ScoreResult(rewards=rewards, num_errors=len(errors), errors=errors)

    def close(self) -> None:
        """Stop the worker processes, if any."""
        self.runner.close()
