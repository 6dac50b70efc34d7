"""Plain data of a rollout: what is asked of a generation server and what comes back.

These types know nothing about HTTP or models. ``protocol.py`` maps them to
and from SGLang's JSON; the embedded server parses the same JSON into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one completion; the names follow SGLang's ``sampling_params``."""

    max_new_tokens: int = 128
    """Most tokens to generate; reaching it finishes with type ``length``."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest prefix of the sorted distribution whose mass
    reaches ``top_p``; 1 keeps everything."""
    top_k: int = -1
    """Keep the ``top_k`` most likely tokens; -1 keeps everything."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (type ``stop``); the matched id stays in the output."""
    ignore_eos: bool = False
    """Do not stop on the model's end-of-sequence tokens."""
    seed: int | None = None
    """Base of the per-sample ``sampling_seed``; None samples without a fixed seed."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")


@dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    """A batch of prompts, each sampled ``num_samples`` times with the same parameters."""

    prompts: tuple[tuple[int, ...], ...]
    """Prompt token ids, one tuple per prompt."""
    num_samples: int = 1
    """Completions per prompt (the GRPO group size)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters shared by every sample."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(tuple(p) for p in self.prompts))
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        for i, prompt in enumerate(self.prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")

    def sample_seed(self, prompt_index: int, sample_index: int) -> int | None:
        """The ``sampling_seed`` of one sample: distinct per sample, reproducible per request.

        SGLang draws identical tokens for identical seeds, so a shared seed
        would make every sample of a group the same completion.
        """
        if self.sampling.seed is None:
            return None
        return self.sampling.seed + prompt_index * self.num_samples + sample_index


@dataclass(frozen=True, kw_only=True)
class FinishReason:
    """Why a completion ended, as SGLang reports it."""

    type: FinishType
    """``stop`` (a stop or EOS token), ``length`` (max_new_tokens) or ``abort``."""
    detail: int | str | list[int] | None = None
    """The matched token for ``stop``, the length for ``length``, the message for ``abort``."""


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One completion of one prompt."""

    prompt_index: int
    """Index of the prompt in ``RolloutRequest.prompts``."""
    sample_index: int
    """Index of this sample within its prompt's group, in [0, num_samples)."""
    prompt_ids: tuple[int, ...]
    """The prompt's token ids."""
    output_ids: tuple[int, ...]
    """Generated token ids, including a matched stop token."""
    rollout_logprobs: tuple[float, ...]
    """Log-probability of each output token under the server's policy, one per token."""
    finish_reason: FinishReason
    """Why generation ended."""
    weight_version: str | None
    """The server's weight version when the sample finished."""
    version_spans: tuple[tuple[str | None, int], ...] = ()
    """(weight version, token count) of each run of output tokens one version generated,
    in order: one span unless a weight update came while the sample was generating."""
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The experts each token went to, int32 ``[len(prompt_ids) + len(output_ids) - 1,
    layers, topk]``: every token but the last (which the server never forwarded), as
    SGLang's ``meta_info.routed_experts``; None when not asked for."""

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.rollout_logprobs):
            raise ValueError(
                f"sample ({self.prompt_index}, {self.sample_index}) has "
                f"{len(self.output_ids)} output tokens but {len(self.rollout_logprobs)} logprobs"
            )
        if self.version_spans and sum(n for _, n in self.version_spans) != len(self.output_ids):
            raise ValueError(
                f"sample ({self.prompt_index}, {self.sample_index}) has "
                f"{len(self.output_ids)} output tokens but version spans {self.version_spans}"
            )
        positions = len(self.prompt_ids) + len(self.output_ids) - 1
        routes = self.routed_experts
        if routes is not None and (routes.ndim != 3 or routes.shape[0] != positions):
            raise ValueError(
                f"sample ({self.prompt_index}, {self.sample_index}) has {len(self.prompt_ids)} "
                f"prompt + {len(self.output_ids)} output tokens, so {positions} routed positions, "
                f"but routed_experts of shape {routes.shape} (want [positions, layers, topk])"
            )
