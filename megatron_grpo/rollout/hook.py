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
from collections.abc import Sequence
from typing import Any

from megatron_grpo.config import RolloutConfig
from megatron_grpo.rollout.episode import (
    EngineSession,
    Episode,
    EpisodeInput,
    Hook,
    RolloutHookError,
    Trajectory,
    check_episode,
    sampling_params,
)

__all__ = [  # what a user's hook imports from here
    "EngineSession",
    "Episode",
    "EpisodeInput",
    "HookRunner",
    "RolloutHookError",
    "Trajectory",
    "load_hook",
]


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
