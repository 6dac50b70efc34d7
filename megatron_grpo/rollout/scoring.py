"""Rewards scored while generation goes on: each prompt group as soon as it is generated.

A group is handed to a scoring thread the moment its last sample is done, so that scoring
overlaps the generation of the other groups instead of following all of it. Only reward
functions that run elsewhere are scored so (worker processes, an async function, a remote
server: ``RewardScorer.runs_elsewhere``); one that runs inline in the trainer (the math
reward's time limit needs the main thread) is scored after generation, as one batch. The
rewards are the same either way.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from megatron_grpo.rewards import RewardError, ScoreResult


class GroupScoring:
    """Scores the groups handed to ``submit``; ``result`` puts them together in prompt order."""

    def __init__(self, scorer, tokenizer, labels: Sequence[Any], metadatas: Sequence[dict]):
        """``labels`` and ``metadatas`` hold one entry per prompt."""
        self.scorer, self.tokenizer = scorer, tokenizer
        self.labels, self.metadatas = labels, metadatas
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scoring")
        self._scored: dict[int, concurrent.futures.Future[ScoreResult]] = {}

    def submit(self, prompt_index: int, group: list[Any]) -> None:
        """Score one prompt's group (returns at once)."""
        self._scored[prompt_index] = self._pool.submit(self._score, prompt_index, group)

    def _score(self, prompt_index: int, group: list[Any]) -> ScoreResult:
        texts = [self.tokenizer.decode(list(g.output_ids), skip_special_tokens=True) for g in group]
        n = len(group)
        return self.scorer.score(
            texts, [self.labels[prompt_index]] * n, [self.metadatas[prompt_index]] * n
        )

    def result(self, group_size: int) -> ScoreResult:
        """Every group's rewards, prompt-major; a reward error names its index in the batch."""
        rewards: list[float] = []
        errors: list[str] = []
        for p in range(len(self.labels)):
            try:
                part = self._scored[p].result()
            except RewardError as e:
                raise RewardError(p * group_size + e.index, e.cause) from e.cause
            rewards += part.rewards
            errors += part.errors
        return ScoreResult(rewards=rewards, num_errors=len(errors), errors=errors)

    def __enter__(self) -> GroupScoring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
