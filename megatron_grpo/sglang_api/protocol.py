"""SGLang's native ``/generate`` JSON, to and from the rollout types: pure functions.

The request asks for what slime asks for: token ids in, ``return_logprob``
with ``logprob_start_len: -1`` (output tokens only) and ``no_stop_trim`` (a
matched stop token stays in ``output_ids``). The client sends a prompt's group in one
request (SGLang's batch form), each sample with its own ``rid`` to abort and its own
``sampling_seed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_grpo.sglang_api.errors import RolloutProtocolError
from megatron_grpo.sglang_api.types import FinishReason, SamplingParams


def sampling_params_to_json(sampling: SamplingParams, *, seed: int | None) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one sample (``n`` is always 1: see module docstring)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        "no_stop_trim": True,
        "n": 1,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def build_generate_payload(
    prompt_ids: Sequence[int], sampling: SamplingParams, *, rid: str, seed: int | None
) -> dict[str, Any]:
    """The ``/generate`` body for one sample of one prompt."""
    return {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_to_json(sampling, seed=seed),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }


def build_batch_payload(
    items: Sequence[tuple[Sequence[int], SamplingParams, str, int | None]],
) -> dict[str, Any]:
    """The ``/generate`` body for several samples at once, ``(input_ids, sampling, rid, seed)``
    each: SGLang's batch form (lists of ``input_ids``, ``sampling_params`` and ``rid``),
    answered by a list in the same order."""
    return {
        "rid": [rid for _, _, rid, _ in items],
        "input_ids": [list(ids) for ids, _, _, _ in items],
        "sampling_params": [sampling_params_to_json(s, seed=seed) for _, s, _, seed in items],
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }


def parse_batch_response(value: Any, count: int) -> list[GenerateResult]:
    """The ``count`` answers of a batch request, in order."""
    if isinstance(value, dict) and count == 1:
        value = [value]
    if not isinstance(value, list) or len(value) != count:
        raise RolloutProtocolError(f"expected a list of {count} results, got {_preview(value)}")
    return [parse_generate_response(v) for v in value]


def finish_reason_to_json(reason: FinishReason) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` object."""
    if reason.type == "stop":
        return {"type": "stop", "matched": reason.detail}
    if reason.type == "length":
        return {"type": "length", "length": reason.detail}
    return {"type": "abort", "message": reason.detail, "status_code": None, "err_type": None}


def finish_reason_from_json(value: Any) -> FinishReason:
    if not isinstance(value, dict) or value.get("type") not in ("stop", "length", "abort"):
        raise RolloutProtocolError(f"finish_reason is not a stop/length/abort object: {value!r}")
    detail_key = {"stop": "matched", "length": "length", "abort": "message"}[value["type"]]
    return FinishReason(type=value["type"], detail=value.get(detail_key))


@dataclass(frozen=True)
class GenerateResult:
    """What the trainer needs from one ``/generate`` answer."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: str | None


def parse_generate_response(value: Any) -> GenerateResult:
    """Read one sample's answer; a one-element list (a batch of one) is accepted too.

    Raises RolloutProtocolError when a field is missing, or when the logprobs
    do not pair one to one with the output tokens.
    """
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        raise RolloutProtocolError(f"expected one /generate result object, got {_preview(value)}")
    output_ids = value.get("output_ids")
    meta = value.get("meta_info")
    if not isinstance(output_ids, list) or not isinstance(meta, dict):
        raise RolloutProtocolError(f"result lacks output_ids or meta_info: {_preview(value)}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise RolloutProtocolError(
            "meta_info.output_token_logprobs is missing: was return_logprob sent?"
        )
    if len(entries) != len(output_ids):
        raise RolloutProtocolError(
            f"{len(output_ids)} output_ids but {len(entries)} output_token_logprobs"
        )
    logprobs = []
    for position, (entry, token) in enumerate(zip(entries, output_ids)):
        if not (isinstance(entry, list) and len(entry) == 3 and entry[1] == token):
            raise RolloutProtocolError(
                f"output_token_logprobs[{position}] = {entry!r} does not match token {token}"
            )
        if not isinstance(entry[0], (int, float)) or math.isnan(entry[0]):
            raise RolloutProtocolError(f"output_token_logprobs[{position}] has no logprob")
        logprobs.append(float(entry[0]))
    version = meta.get("weight_version")
    return GenerateResult(
        output_ids=tuple(int(t) for t in output_ids),
        logprobs=tuple(logprobs),
        finish_reason=finish_reason_from_json(meta.get("finish_reason")),
        weight_version=None if version is None else str(version),
    )


def _preview(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
