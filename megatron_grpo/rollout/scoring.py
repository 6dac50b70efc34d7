"""Rewards scored while generation goes on: each prompt group as soon as it is generated.

A group is handed to a scoring thread the moment its last sample is done, so that scoring
overlaps the generation of the other groups instead of following all of it. Only reward
functions that run elsewhere are scored so (worker processes, an async function, a remote
server: ``RewardScorer.runs_elsewhere``); one that runs inline in the trainer (the math
reward's time limit needs the main thread) is scored after generation, as one batch. The
rewards are the same either way. With ``reward.on_error=fail`` the first group that fails
ends the scoring: the groups queued or generated after it are not scored, and ``result``
raises its error; with ``zero``, one line logs the failures of all groups together.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

from megatron_grpo.rewards import RewardError, ScoreResult

logger = logging.getLogger(__name__)


class GroupScoring:
    """Scores the groups handed to ``submit``; ``result`` puts them together in prompt order."""

    def __init__(
        self,
        scorer,
        tokenizer,
        labels: Sequence[Any],
        metadatas: Sequence[dict],
        prompts: Sequence[str] | None = None,
    ):
        """``labels``, ``metadatas`` and ``prompts`` (the prompts' text, for a TRL-style
        reward) hold one entry per prompt."""
        self.scorer, self.tokenizer = scorer, tokenizer
        self.labels, self.metadatas, self.prompts = labels, metadatas, prompts
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scoring")
        self._scored: dict[int, concurrent.futures.Future[ScoreResult | None]] = {}
        self._failed = threading.Event()

    def submit(self, prompt_index: int, group: list[Any]) -> None:
        """Score one prompt's group (returns at once; nothing once a group has failed)."""
        if not self._failed.is_set():
            self._scored[prompt_index] = self._pool.submit(self._score, prompt_index, group)

    def _score(self, prompt_index: int, group: list[Any]) -> ScoreResult | None:
        if self._failed.is_set():
            return None  # a group before it failed: result() raises that
        texts = [self.tokenizer.decode(list(g.output_ids), skip_special_tokens=True) for g in group]
        n = len(group)
        labels, metadatas = [self.labels[prompt_index]] * n, [self.metadatas[prompt_index]] * n
        prompts = None if self.prompts is None else [self.prompts[prompt_index]] * n
        ids = [list(g.output_ids) for g in group]
        try:
            return self.scorer.score(
                texts, labels, metadatas, prompts=prompts, completion_ids=ids, warn=False
            )
        except RewardError:
            self._failed.set()
            raise

    def result(self, group_size: int) -> ScoreResult:
        """Every group's rewards, prompt-major; a reward error names its index in the batch."""
        for p, scored in sorted(self._scored.items()):
            error = scored.exception()
            if isinstance(error, RewardError):
                raise RewardError(
                    p * group_size + error.index, error.cause,
                    reward=error.reward, response=error.response,
                ) from error.cause  # fmt: skip
        rewards: list[float] = []
        errors: list[str] = []
        for p in range(len(self.labels)):
            part = self._scored[p].result()
            assert part is not None  # only after a failure, raised above
            rewards += part.rewards
            errors += [_renumbered(e, p * group_size) for e in part.errors]
        if errors:
            logger.warning(
                "reward %s: %d of %d samples failed, scored 0; first: %s",
                self.scorer.name, len(errors), len(rewards), errors[0],
            )  # fmt: skip
        return ScoreResult(rewards=rewards, num_errors=len(errors), errors=errors)

    def __enter__(self) -> GroupScoring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _renumbered(error: str, offset: int) -> str:
    """A group's ``sample <i>: ...`` line with ``i`` counted in the batch."""
    index, _, rest = error.removeprefix("sample ").partition(":")
    return f"sample {int(index) + offset}:{rest}"
