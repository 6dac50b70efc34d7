"""A sample generated in segments: what it has so far, across the weight updates that cut it.

A weight update while a group generates aborts its samples with their tokens so far
(``SGLangClient.hold_generation``); each is sent again as prompt + its tokens, with the
budget left. ``Partial`` adds up the segments: tokens, their log-probs, and the weight
version of each run of tokens (``Generation.version_spans``). Its routed experts are its
latest segment's: that request had prompt + every token so far as input, so its routes
cover them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_grpo.sglang_api.errors import RolloutError
from megatron_grpo.sglang_api.protocol import GenerateResult
from megatron_grpo.sglang_api.types import FinishReason, Generation


@dataclass
class Partial:
    sample_index: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[str | None, int]] = field(default_factory=list)
    routes: np.ndarray | None = field(default=None, compare=False)

    def add(self, result: GenerateResult) -> None:
        self.output += result.output_ids
        self.logprobs += result.logprobs
        if result.output_ids:
            self.spans.append((result.weight_version, len(result.output_ids)))
        # A segment aborted before it ran has no routes and no new tokens: the last still hold.
        if result.routed_experts is not None or result.output_ids:
            self.routes = result.routed_experts

    def generation(
        self, prompt_index: int, prompt: tuple[int, ...], finish: FinishReason, version: str | None
    ) -> Generation:
        return Generation(
            prompt_index=prompt_index,
            sample_index=self.sample_index,
            prompt_ids=tuple(prompt),
            output_ids=tuple(self.output),
            rollout_logprobs=tuple(self.logprobs),
            finish_reason=finish,
            weight_version=version,
            version_spans=tuple(self.spans),
            routed_experts=self.routes,
        )


class GroupFailed(Exception):
    """A group's request failed: the samples it finished before, and those it did not."""

    def __init__(self, completed: list[Generation], failed: list[int], error: RolloutError):
        super().__init__(str(error))
        self.completed, self.failed, self.error = completed, failed, error
