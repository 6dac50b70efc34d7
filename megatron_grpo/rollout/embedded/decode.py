"""Batched autoregressive decoding with a Hugging Face causal LM and its KV cache.

``generate_batch`` runs a batch of sequences, each with its own sampling
parameters and random generator, until every one has finished: stop or EOS
token (kept in the output), ``max_new_tokens``, or an abort from
``before_step``. Prompts are left-padded into one tensor; finished rows are
dropped from the batch and the cache so the long tail costs only its own rows.

The returned logprob of each token is ``log_softmax`` of the raw logits
(temperature 1, before top-k/top-p): the log-probability of the token under
the unmodified policy, which is what the trainer recomputes. SGLang by default
returns the logprob under the temperature-scaled distribution (also before
top-k/top-p) and the raw one with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; the
two agree at temperature 1 and for greedy decoding.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from megatron_grpo.rollout.embedded.sampling import sample_next_tokens, token_logprobs
from megatron_grpo.rollout.types import FinishReason, SamplingParams

BeforeStep = Callable[[], Mapping[int, str]]
"""Called before each new token, again until it names no unfinished row: the rows to abort,
each with a message. It may block (a paused server); it should then return early when a
row is to be aborted meanwhile."""
OnFinish = Callable[[int, "Completion"], None]
"""Called once per row as soon as it finishes, with its index in ``specs``."""


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    """Seed of this row's generator (the sample's sampling_seed, or one drawn by the engine)."""


@dataclass
class Completion:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None


def generate_batch(
    model: PreTrainedModel,
    specs: Sequence[SequenceSpec],
    *,
    eos_token_ids: frozenset[int],
    before_step: BeforeStep | None = None,
    on_finish: OnFinish | None = None,
) -> list[Completion]:
    """Generate every sequence of ``specs``; the model must be in eval mode."""
    completions = [Completion([], []) for _ in specs]

    def finish(row: int, reason: FinishReason) -> None:
        completions[row].finish_reason = reason
        if on_finish is not None:
            on_finish(row, completions[row])

    rows = list(range(len(specs)))  # original index of each live batch row
    for row, spec in enumerate(specs):
        if spec.sampling.max_new_tokens == 0:
            finish(row, FinishReason(type="length", detail=0))
    _abort(completions, before_step, finish)
    rows = [r for r in rows if completions[r].finish_reason is None]
    if not rows:
        return completions

    device = next(model.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(s.seed) for s in specs]
    temperature = torch.tensor([s.sampling.temperature for s in specs], device=device)
    top_k = torch.tensor([s.sampling.top_k for s in specs], device=device)
    top_p = torch.tensor([s.sampling.top_p for s in specs], device=device)
    stops = [
        frozenset(s.sampling.stop_token_ids)
        | (frozenset() if s.sampling.ignore_eos else eos_token_ids)
        for s in specs
    ]

    step = _Stepper(model, [specs[r].prompt_ids for r in rows], device)
    with torch.inference_mode():
        logits_BV = step.prefill()
        while True:
            _abort(completions, before_step, finish)
            index = torch.tensor(rows, device=device)
            tokens_B = sample_next_tokens(
                logits_BV,
                temperature[index],
                top_k[index],
                top_p[index],
                [generators[r] for r in rows],
            )
            logprobs_B = token_logprobs(logits_BV, tokens_B)
            for b, r in enumerate(rows):
                done = completions[r]
                if done.finish_reason is not None:
                    continue  # aborted before this step
                token = int(tokens_B[b])
                done.output_ids.append(token)
                done.logprobs.append(float(logprobs_B[b]))
                if token in stops[r]:
                    finish(r, FinishReason(type="stop", detail=token))
                elif len(done.output_ids) == specs[r].sampling.max_new_tokens:
                    finish(r, FinishReason(type="length", detail=len(done.output_ids)))
            keep = [b for b, r in enumerate(rows) if completions[r].finish_reason is None]
            if not keep:
                return completions
            if len(keep) < len(rows):
                step.select(keep)
                rows = [rows[b] for b in keep]
                tokens_B = tokens_B[keep]
            logits_BV = step.decode(tokens_B)


def _abort(
    completions: list[Completion],
    before_step: BeforeStep | None,
    finish: Callable[[int, FinishReason], None],
) -> None:
    while before_step is not None:
        aborts = before_step()
        live = {r: m for r, m in aborts.items() if completions[r].finish_reason is None}
        if not live:
            return
        for row, message in live.items():
            finish(row, FinishReason(type="abort", detail=message))


class _Stepper:
    """The model's forward passes for a shrinking batch of left-padded rows."""

    def __init__(
        self, model: PreTrainedModel, prompts: Sequence[tuple[int, ...]], device: torch.device
    ) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`.
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.cache: Any = None  # the model builds the right cache type on the first call
        width = max(len(p) for p in prompts)
        self.input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        # Without padding no mask is needed, and building one costs a lot per step.
        self.mask: torch.Tensor | None = None
        if any(len(p) != width for p in prompts):
            self.mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for b, prompt in enumerate(prompts):
            self.input_ids[b, width - len(prompt) :] = torch.tensor(prompt, device=device)
            if self.mask is not None:
                self.mask[b, width - len(prompt) :] = 1
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.positions = torch.arange(width, device=device)[None, :] - (width - lengths)[:, None]
        self.positions = self.positions.clamp(min=0)

    def prefill(self) -> torch.Tensor:
        return self._forward(self.input_ids, self.positions)

    def decode(self, tokens_B: torch.Tensor) -> torch.Tensor:
        self.positions = self.positions[:, -1:] + 1
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens_B), 1)], dim=1)
        return self._forward(tokens_B[:, None], self.positions)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.positions.device)
        self.cache.batch_select_indices(index)
        self.positions = self.positions[index]
        if self.mask is not None:
            self.mask = self.mask[index]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {self.cache_kwarg: self.cache}
        if self.keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **kwargs,
        )
        cache = getattr(out, "cache", None)
        self.cache = out.past_key_values if cache is None else cache
        return out.logits[:, -1, :].float()
