"""Rollout hooks: a user's async function makes each sample, talking to the engines itself.

``rollout.hook: package.module:function`` names an ``async def hook(episode:
EpisodeInput, engine: EngineSession) -> Episode``; ``rollout.hook: tools`` is the
built-in multi-turn tool loop (rollout/tools/loop.py). The hook generates with
``engine.generate(token_ids)``, one turn at a time, and may add tokens of its own between
turns (a tool's output). Token in, token out: the hook hands back the very ids the engine
saw and generated, never a re-tokenized text, so the learner scores exactly the
sequence that was sampled. A ``Trajectory`` does the bookkeeping: the model's tokens with
loss mask 1 and the engine's log-probs, anything else with mask 0.

The runner checks each episode (aligned lengths, a 0/1 mask, at most
``rollout.max_new_tokens`` tokens after the prompt) and the rollout stage turns it into
a training sample: prompt + response, loss mask 0 on the prompt and on whatever the
hook added, so tool output counts in no denominator (T, N, T_g, G_g).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.config import RolloutConfig
from megatron_grpo.rollout.types import FinishReason, Generation, RolloutRequest, SamplingParams

TURN_SEED_STRIDE = 100_003
"""Seed offset of an episode's successive turns (each turn is its own request)."""


class RolloutHookError(RuntimeError):
    """A rollout hook raised, or handed back an episode that is not a valid sample."""


@dataclass(frozen=True, kw_only=True)
class EpisodeInput:
    """What a hook is given for one sample."""

    prompt_ids: tuple[int, ...]
    """The prompt's token ids (chat template applied)."""
    label: Any
    """The dataset row's label (what the reward compares with)."""
    metadata: dict[str, Any]
    """The row's other columns."""
    prompt_index: int
    """The prompt's index in this sampling round."""
    sample_index: int
    """The sample's index within its prompt's group."""


@dataclass(frozen=True, kw_only=True)
class Episode:
    """What a hook hands back: the response after the prompt, aligned token by token."""

    response_ids: tuple[int, ...]
    """Every token after the prompt: the model's turns and what the hook added between them."""
    loss_mask: tuple[float, ...]
    """1.0 on the model's own tokens to train on, 0.0 on added tokens (tool output)."""
    rollout_logprobs: tuple[float, ...]
    """The engine's log-probability of each model token; 0.0 on added tokens."""
    finish_reason: FinishReason
    """How the episode ended (``length``: cut by the token budget or the turn limit)."""
    response_text: str | None = None
    """The text the reward function reads; None: the whole response, decoded."""
    reward_metadata: dict[str, Any] = field(default_factory=dict)
    """Added to the row's metadata that the reward function receives."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-episode numbers, logged as their mean over the step (``rollout/<name>_mean``)."""
    prompt_ids: tuple[int, ...] = ()
    """The prompt, filled in by the runner."""

    def __post_init__(self) -> None:
        for name in ("response_ids", "loss_mask", "rollout_logprobs", "prompt_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def output_ids(self) -> tuple[int, ...]:
        """The response, as ``Generation.output_ids`` (what lengths and decoding read)."""
        return self.response_ids


class Trajectory:
    """An episode being built: the context so far and the response's aligned arrays."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = tuple(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[float] = []
        self.rollout_logprobs: list[float] = []

    @property
    def context(self) -> list[int]:
        """Prompt and response so far: the next turn's input, exactly."""
        return [*self.prompt_ids, *self.response_ids]

    def add_model_turn(self, turn: Generation) -> None:
        """The engine's tokens, trained on, with its log-probs."""
        self.response_ids += turn.output_ids
        self.loss_mask += [1.0] * len(turn.output_ids)
        self.rollout_logprobs += turn.rollout_logprobs

    def add_tokens(self, ids: Sequence[int]) -> None:
        """Tokens the model did not generate (a tool's output): loss mask 0."""
        self.response_ids += ids
        self.loss_mask += [0.0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    def episode(self, finish_reason: FinishReason, **extra: Any) -> Episode:
        return Episode(
            response_ids=tuple(self.response_ids),
            loss_mask=tuple(self.loss_mask),
            rollout_logprobs=tuple(self.rollout_logprobs),
            finish_reason=finish_reason,
            **extra,
        )


class EngineSession:
    """One episode's handle on the engines: ``generate`` a turn from token ids."""

    def __init__(self, client: Any, sampling: SamplingParams, tokenizer: Any) -> None:
        self.client = client
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.num_turns = 0

    @property
    def max_new_tokens(self) -> int:
        """The episode's token budget after the prompt (``rollout.max_new_tokens``)."""
        return self.sampling.max_new_tokens

    async def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Generation:
        """One completion of ``token_ids`` with the run's sampling settings; ``stop_token_ids``
        end it besides the run's own stop tokens (the matched token stays in the output)."""
        seed = self.sampling.seed
        params = dataclasses.replace(
            self.sampling,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            stop_token_ids=(*self.sampling.stop_token_ids, *stop_token_ids),
            seed=None if seed is None else seed + TURN_SEED_STRIDE * self.num_turns,
        )
        self.num_turns += 1
        request = RolloutRequest(prompts=(tuple(token_ids),), num_samples=1, sampling=params)
        (turn,) = await self.client.generate(request)
        return turn


Hook = Callable[[EpisodeInput, EngineSession], Awaitable[Episode]]


def sampling_params(
    cfg: RolloutConfig, *, seed: int, stop_token_ids: Sequence[int]
) -> SamplingParams:
    """The run's sampling settings (a rollout's, or one episode's), its seed included."""
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )


def check_episode(episode: Episode, budget: int) -> None:
    """A ValueError saying what is wrong with an episode, if anything."""
    n = len(episode.response_ids)
    if not n == len(episode.loss_mask) == len(episode.rollout_logprobs):
        raise ValueError(
            f"response_ids, loss_mask and rollout_logprobs differ in length: {n}, "
            f"{len(episode.loss_mask)}, {len(episode.rollout_logprobs)}"
        )
    if n == 0:
        raise ValueError("the episode has no response tokens")
    if n > budget:
        raise ValueError(f"{n} response tokens, over rollout.max_new_tokens={budget}")
    if any(m not in (0.0, 1.0) for m in episode.loss_mask):
        raise ValueError("loss_mask must hold only 0.0 and 1.0")


class HookRunner:
    """Runs a hook for every sample of a sampling round, on the runtime's engines."""

    def __init__(self, hook: Hook, name: str, tokenizer: Any) -> None:
        self.hook, self.name, self.tokenizer = hook, name, tokenizer

    def generate_groups(
        self,
        items: Sequence[Any],
        runtime: Any,
        cfg: RolloutConfig,
        *,
        seed: int,
        stop_token_ids: Sequence[int],
    ) -> list[list[Episode]]:
        """``cfg.samples_per_prompt`` episodes of each item (``prompt_ids``, ``label``,
        ``metadata``), grouped by prompt."""
        n = cfg.samples_per_prompt

        async def run_all(client: Any) -> list[Any]:
            jobs = [
                self._episode(client, item, p, s, cfg, seed + p * n + s, stop_token_ids)
                for p, item in enumerate(items)
                for s in range(n)
            ]
            return await asyncio.gather(*jobs, return_exceptions=True)

        flat = runtime.run_on_engines(run_all)
        for outcome in flat:
            if isinstance(outcome, BaseException):
                raise outcome
        return [flat[p * n : (p + 1) * n] for p in range(len(items))]

    async def _episode(
        self,
        client: Any,
        item: Any,
        p: int,
        s: int,
        cfg: RolloutConfig,
        seed: int,
        stop_token_ids: Sequence[int],
    ) -> Episode:
        given = EpisodeInput(
            prompt_ids=tuple(item.prompt_ids),
            label=item.label,
            metadata=dict(item.metadata),
            prompt_index=p,
            sample_index=s,
        )
        engine = EngineSession(
            client, sampling_params(cfg, seed=seed, stop_token_ids=stop_token_ids), self.tokenizer
        )
        try:
            episode = await self.hook(given, engine)
            if not isinstance(episode, Episode):
                raise TypeError(f"returned {type(episode).__name__}, not an Episode")
            check_episode(episode, cfg.max_new_tokens)
        except Exception as e:
            raise RolloutHookError(
                f"rollout.hook {self.name!r} failed on prompt {p} sample {s}: "
                f"{type(e).__name__}: {e}"
            ) from e
        return dataclasses.replace(episode, prompt_ids=given.prompt_ids)


def load_hook(cfg: RolloutConfig, tokenizer: Any) -> HookRunner | None:
    """The runner of ``cfg.hook`` (None without one); a ValueError names a bad hook."""
    import inspect

    from megatron_grpo.rewards.custom import load_function

    if cfg.hook is None:
        return None
    if cfg.hook == "tools":
        from megatron_grpo.rollout.tools.loop import ToolLoop

        return HookRunner(ToolLoop(cfg.tools, tokenizer), "tools", tokenizer)
    fn = load_function(cfg.hook, "rollout.hook")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ValueError(f"rollout.hook {cfg.hook!r} must be an async function (async def)")
    return HookRunner(fn, cfg.hook, tokenizer)


# ---- what the rollout stage reads of an episode (or of a plain Generation) ----


def response_text(gen: Any, tokenizer: Any) -> str:
    """The text the reward reads."""
    if isinstance(gen, Episode) and gen.response_text is not None:
        return gen.response_text
    return tokenizer.decode(list(gen.output_ids), skip_special_tokens=True)


def reward_metadata(gen: Any, row_metadata: dict[str, Any]) -> dict[str, Any]:
    """The row's metadata, with an episode's own added."""
    if isinstance(gen, Episode) and gen.reward_metadata:
        return {**row_metadata, **gen.reward_metadata}
    return row_metadata


def episode_stats(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each episode metric, as ``<name>_mean`` (episodes without it count 0)."""
    names = sorted({k for m in metrics for k in m})
    return {f"{k}_mean": sum(m.get(k, 0.0) for m in metrics) / len(metrics) for k in names}
