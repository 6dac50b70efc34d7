"""Batched autoregressive decoding with a Hugging Face causal LM and its KV cache.

``generate_batch`` runs a batch of sequences, each with its own sampling
parameters and seed, until every one has finished: stop or EOS
token (kept in the output), ``max_new_tokens``, or an abort from
``before_step``. Prompts are left-padded into one tensor; finished rows are
dropped from the batch and the cache (once a quarter of it has finished, or a row
reaches its token limit) so the long tail costs only its own rows.

The returned logprob of each token is ``log_softmax`` of the raw logits
(temperature 1, before top-k/top-p): the log-probability of the token under
the unmodified policy, which is what the trainer recomputes. SGLang by default
returns the logprob under the temperature-scaled distribution (also before
top-k/top-p) and the raw one with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``; the
two agree at temperature 1 and for greedy decoding.

A row that asks for its routed experts gets them as SGLang returns them: the experts
of every token the model ran, prompt + output but the last token (``routes.py`` records
them; ``_RowRoutes`` keeps each row's, without the left padding). Only a batch with such
a row hooks the routers.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from megatron_grpo.embedded.routes import RouteRecorder
from megatron_grpo.embedded.sampling import sample_next_tokens, token_logprobs
from megatron_grpo.sglang_api.types import FinishReason, SamplingParams

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
    return_routed_experts: bool = False
    """Record the experts each of its tokens went to (the model must have MoE layers)."""


@dataclass
class Completion:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    routed_experts: np.ndarray | None = None
    """int32 ``[prompt + output tokens - 1, layers, topk]`` when asked for; None too for a
    row that ended before the model ran it (no budget, or aborted first)."""


def generate_batch(
    model: PreTrainedModel,
    specs: Sequence[SequenceSpec],
    *,
    eos_token_ids: frozenset[int],
    before_step: BeforeStep | None = None,
    on_finish: OnFinish | None = None,
) -> list[Completion]:
    """Generate every sequence of ``specs``; the model must be in eval mode.

    Every row of a batch is at the same position, so the tokens and log-probs of a
    step go into one column of a buffer, and only the rows that finish at a step
    are looked at one by one (their outputs turn into lists then).
    """
    rows = _Rows(specs, eos_token_ids, next(model.parameters()).device)
    wants_routes = any(spec.return_routed_experts for spec in specs)
    routes = _RowRoutes(model, specs, rows.max_new) if wants_routes else None

    def finish(ended: list[tuple[int, FinishReason]]) -> None:
        rows.finish(ended)
        if routes is not None:
            for row, _ in ended:
                done = rows.completions[row]
                done.routed_experts = routes.of(row, len(done.output_ids))
        if on_finish is not None:
            for row, _ in ended:
                on_finish(row, rows.completions[row])

    finish(
        [
            (row, FinishReason(type="length", detail=0))
            for row, spec in enumerate(specs)
            if spec.sampling.max_new_tokens == 0
        ]
    )
    _abort(rows.completions, before_step, finish)
    live = [r for r, c in enumerate(rows.completions) if c.finish_reason is None]
    if not live:
        return rows.completions

    step = _Stepper(model, [specs[r].prompt_ids for r in live], rows.device)
    index_B = torch.tensor(live, device=rows.device)
    with torch.inference_mode(), routes.recorder if routes else contextlib.nullcontext():
        logits_BV = step.prefill()
        if routes is not None:
            routes.prefill(step, live)
        for position in range(rows.max_new):
            _abort(rows.completions, before_step, finish)
            tokens_B = rows.sample(logits_BV, index_B, position)
            stop_B = (tokens_B[:, None] == rows.stops_NS[index_B]).any(dim=1)
            length_B = rows.max_new_N[index_B] == position + 1
            finish(
                [
                    (live[b], reason)
                    for b, reason in _finished(stop_B, length_B, tokens_B, position)
                    if rows.completions[live[b]].finish_reason is None
                ]
            )
            keep = [b for b, r in enumerate(live) if rows.completions[r].finish_reason is None]
            if not keep:
                break
            # Rows that stopped ride along (their tokens unused) until a quarter of the batch
            # has: each shrink copies the KV cache. A row at its own token limit leaves at
            # once, so that no row runs past its prompt + max_new_tokens.
            ended = len(live) - len(keep)
            if ended and (4 * ended >= len(live) or bool(length_B.any())):
                step.select(keep)
                live = [live[b] for b in keep]
                index_B = index_B[keep]
                tokens_B = tokens_B[keep]
            logits_BV = step.decode(tokens_B)
            if routes is not None:
                routes.decode(live, position)
    return rows.completions


def _finished(
    stop_B: torch.Tensor, length_B: torch.Tensor, tokens_B: torch.Tensor, position: int
) -> list[tuple[int, FinishReason]]:
    """The batch rows that end at this step, with why (a stop token wins over the length)."""
    done = torch.nonzero(stop_B | length_B).flatten().tolist()
    if not done:
        return []
    stops, tokens = stop_B.tolist(), tokens_B.tolist()
    return [
        (b, FinishReason(type="stop", detail=tokens[b]))
        if stops[b]
        else (b, FinishReason(type="length", detail=position + 1))
        for b in done
    ]


class _Rows:
    """Sampling parameters of every row as tensors, and the buffers of what they generate."""

    def __init__(
        self, specs: Sequence[SequenceSpec], eos_token_ids: frozenset[int], device: torch.device
    ) -> None:
        self.device = device
        self.completions = [Completion([], []) for _ in specs]
        self.max_new = max((s.sampling.max_new_tokens for s in specs), default=0)
        self.max_new_N = torch.tensor([s.sampling.max_new_tokens for s in specs], device=device)
        self.temperature_N = torch.tensor([s.sampling.temperature for s in specs], device=device)
        self.top_k_N = torch.tensor([s.sampling.top_k for s in specs], device=device)
        self.top_p_N = torch.tensor([s.sampling.top_p for s in specs], device=device)
        self.seed_N = torch.tensor([s.seed for s in specs], dtype=torch.long, device=device)
        stops = [
            sorted(
                set(s.sampling.stop_token_ids) | (set() if s.sampling.ignore_eos else eos_token_ids)
            )
            for s in specs
        ]
        width = max((len(x) for x in stops), default=0) or 1
        self.stops_NS = torch.tensor(
            [x + [-1] * (width - len(x)) for x in stops], dtype=torch.long, device=device
        )
        self.tokens_NT = torch.zeros(len(specs), self.max_new, dtype=torch.long, device=device)
        self.logprobs_NT = torch.zeros(len(specs), self.max_new, device=device)
        self.generated = 0
        """Tokens generated so far by every row still live (they all move together)."""

    def sample(self, logits_BV: torch.Tensor, index_B: torch.Tensor, position: int):
        """Draw the tokens at ``position`` of the rows ``index_B`` and record them."""
        tokens_B = sample_next_tokens(
            logits_BV,
            self.temperature_N[index_B],
            self.top_k_N[index_B],
            self.top_p_N[index_B],
            self.seed_N[index_B],
            torch.full_like(index_B, position),
        )
        self.tokens_NT[index_B, position] = tokens_B
        self.logprobs_NT[index_B, position] = token_logprobs(logits_BV, tokens_B)
        self.generated = position + 1
        return tokens_B

    def finish(self, ended: list[tuple[int, FinishReason]]) -> None:
        """End these rows with what they generated so far (one copy to lists for all)."""
        if not ended:
            return
        n = self.generated
        index = torch.tensor([row for row, _ in ended], device=self.device)
        tokens, logprobs = self.tokens_NT[index, :n].tolist(), self.logprobs_NT[index, :n].tolist()
        for (row, reason), toks, lps in zip(ended, tokens, logprobs, strict=True):
            done = self.completions[row]
            done.output_ids, done.logprobs, done.finish_reason = toks, lps, reason


class _RowRoutes:
    """The expert ids of every row's tokens, recorded while ``recorder`` is entered: its
    prompt's from the prefill, then one per decoding step (the output token fed then)."""

    def __init__(self, model: PreTrainedModel, specs: Sequence[SequenceSpec], max_new: int):
        self.recorder = RouteRecorder(model)
        self.specs = specs
        self.prompt: list[torch.Tensor | None] = [None] * len(specs)
        num_layers, top_k = len(self.recorder.routers), self.recorder.top_k
        self.output_NTLK = torch.zeros(len(specs), max_new, num_layers, top_k, dtype=torch.int32)

    def prefill(self, step: _Stepper, live: list[int]) -> None:
        """Keep each live row's prompt ids from the prefill of the distinct prompts, which
        ran left-padded to one width."""
        ids_DWLK = self.recorder.take(*step.input_ids.shape)
        width = ids_DWLK.shape[1]
        for d, row in zip(step.prompt_of_row, live, strict=True):
            self.prompt[row] = ids_DWLK[d, width - len(self.specs[row].prompt_ids) :]

    def decode(self, live: list[int], position: int) -> None:
        """Keep the ids of output token ``position``, which the live rows just fed."""
        self.output_NTLK[live, position] = self.recorder.take(len(live), 1)[:, 0]

    def of(self, row: int, num_output: int) -> np.ndarray | None:
        """The row's ids over prompt + output tokens but the last, if asked for and run."""
        prompt = self.prompt[row]
        if not self.specs[row].return_routed_experts or prompt is None:
            return None
        every = torch.cat([prompt, self.output_NTLK[row, :num_output]])
        return every[: len(prompt) + num_output - 1].numpy()


def _abort(
    completions: list[Completion],
    before_step: BeforeStep | None,
    finish: Callable[[list[tuple[int, FinishReason]]], None],
) -> None:
    while before_step is not None:
        aborts = before_step()
        live = {r: m for r, m in aborts.items() if completions[r].finish_reason is None}
        if not live:
            return
        finish([(row, FinishReason(type="abort", detail=m)) for row, m in live.items()])


class _Stepper:
    """The model's forward passes for a shrinking batch of left-padded rows.

    Rows with the same prompt (the samples of a GRPO group) share one prefill: the
    distinct prompts run through the model once, and their KV cache, positions and
    last logits are then copied to every row that has them.
    """

    def __init__(
        self, model: PreTrainedModel, prompts: Sequence[tuple[int, ...]], device: torch.device
    ) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`.
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.cache: Any = None  # the model builds the right cache type on the first call
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        self.prompt_of_row = source
        """Each row's prompt, as an index into the distinct prompts (the prefill's rows)."""
        self.copy_rows = (
            torch.tensor(source, device=device) if len(distinct) < len(prompts) else None
        )
        width = max(len(p) for p in distinct)
        self.input_ids = torch.tensor(
            [[0] * (width - len(p)) + list(p) for p in distinct], dtype=torch.long, device=device
        )
        # Without padding no mask is needed, and building one costs a lot per step.
        self.mask: torch.Tensor | None = None
        if any(len(p) != width for p in distinct):
            self.mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in distinct], device=device
            )
        lengths = torch.tensor([len(p) for p in distinct], device=device)
        self.positions = torch.arange(width, device=device)[None, :] - (width - lengths)[:, None]
        self.positions = self.positions.clamp(min=0)

    def prefill(self) -> torch.Tensor:
        logits_BV = self._forward(self.input_ids, self.positions)
        if self.copy_rows is None:
            return logits_BV
        self._take(self.copy_rows)
        return logits_BV[self.copy_rows]

    def decode(self, tokens_B: torch.Tensor) -> torch.Tensor:
        self.positions = self.positions[:, -1:] + 1
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens_B), 1)], dim=1)
        return self._forward(tokens_B[:, None], self.positions)

    def select(self, keep: list[int]) -> None:
        self._take(torch.tensor(keep, device=self.positions.device))

    def _take(self, index: torch.Tensor) -> None:
        """Rows ``index`` of the cache, positions and mask (a row may be taken twice)."""
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
