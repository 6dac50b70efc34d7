"""An episode: one sample made in several turns, and what a rollout hook is handed to make it.

A hook (rollout/hook.py) is given an ``EpisodeInput`` and an ``EngineSession``; it
generates turn by turn with ``engine.generate(token_ids)`` and hands back an ``Episode`` of
token ids, loss mask and the engine's log-probs, which a ``Trajectory`` assembles: the
model's tokens with loss mask 1 and their log-probs, anything the hook adds (a tool's
output) with mask 0. ``check_episode`` is what every episode must satisfy. The built-in
tool loop (rollout/tools/loop.py) is made of these too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.config import RolloutConfig
from megatron_grpo.sglang_api.types import FinishReason, Generation, RolloutRequest, SamplingParams

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
    routed_experts: Any = field(default=None, compare=False)
    """[positions, L, K] the experts the engine routed the prompt and response to, from the
    start (a numpy array, as ``Generation.routed_experts``); None when not asked for."""

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
        self.routed_experts: Any = None

    @property
    def context(self) -> list[int]:
        """Prompt and response so far: the next turn's input, exactly."""
        return [*self.prompt_ids, *self.response_ids]

    def add_model_turn(self, turn: Generation) -> None:
        """The engine's tokens, trained on, with its log-probs; its routes when the turn's
        input was the context so far (they then cover the whole episode up to the turn's
        last token; a turn of other input leaves the episode without routes)."""
        routes = getattr(turn, "routed_experts", None)
        aligned = tuple(turn.prompt_ids) == tuple(self.context)
        self.routed_experts = routes if aligned else None
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
            routed_experts=self.routed_experts,
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
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
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
