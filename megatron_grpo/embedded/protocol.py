"""The embedded server's reading of a ``/generate`` body and writing of its answer.

Pure functions. The body is read as SGLang reads it: ``input_ids`` (one list,
or a list of lists for a batch) or ``text``; ``sampling_params`` (one object
for all, or one per prompt); ``n`` samples per prompt; unknown top-level keys
ignored; an unknown ``sampling_params`` key rejected with SGLang's message.
Parameters SGLang knows but this server does not implement are rejected when
set to anything but their default, so a request never silently means less
than it says. ``return_routed_experts`` is one bool for the whole body, as in SGLang
(``megatron_grpo.sglang_api.protocol`` has its format).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_grpo.sglang_api.protocol import encode_routed_experts, finish_reason_to_json
from megatron_grpo.sglang_api.types import FinishReason, SamplingParams

# SGLang 0.5.23's SamplingParams fields, in its order (the 400 message lists them).
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip

# Known to SGLang, not implemented here: each must be absent or one of these values.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []),
    "stop_regex": (None, "", []),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_new_tokens": (None, 0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None,),
    "beam_width": (None, 0, 1),
    "watermark": (None,),
    "choice": (None, []),
}


# Output-token logprobs only: prompt logprobs and top-k logprobs are not implemented.
_UNSUPPORTED_TOP_LEVEL: dict[str, tuple[Any, ...]] = {
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "routed_experts_start_len": (None, 0),
}


class BadRequest(ValueError):
    """The body cannot be served; the server answers HTTP 400 ``{"error": str(err)}``."""


@dataclass(frozen=True)
class GenerateItem:
    """One sequence to generate, from a (prompt, sample) of the body."""

    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool
    skip_special_tokens: bool
    return_routed_experts: bool = False


@dataclass(frozen=True)
class ParsedGenerate:
    items: list[GenerateItem]
    """Prompt-major: all samples of prompt 0, then prompt 1, ..."""
    single: bool
    """One prompt and n == 1: the answer is one object, not a list."""
    return_text_in_logprobs: bool


def parse_generate_body(body: Any, *, encode: Callable[[str], list[int]] | None) -> ParsedGenerate:
    """Read a ``/generate`` body; raises BadRequest naming the offending field."""
    if not isinstance(body, dict):
        raise BadRequest("the /generate body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded server")
    prompts, single = _prompts(body, encode)
    num = len(prompts)
    params = _per_prompt(body.get("sampling_params"), num, "sampling_params", {})
    return_logprob = _per_prompt(body.get("return_logprob"), num, "return_logprob", False)
    for key, allowed in _UNSUPPORTED_TOP_LEVEL.items():
        value = body.get(key)
        for v in value if isinstance(value, list) and key != "token_ids_logprob" else [value]:
            if v not in allowed:
                raise BadRequest(f"{key}={v!r} is not supported by the embedded server")
    rids = _rids(body.get("rid"), num)
    routes = _bool(body.get("return_routed_experts", False), "return_routed_experts")
    items: list[GenerateItem] = []
    ns = []
    for i, prompt in enumerate(prompts):
        sampling, n, skip_special = _sampling(params[i], f"sampling_params[{i}]" if num > 1 else "")
        ns.append(n)
        for j in range(n):
            rid = rids[i] if n == 1 else f"{rids[i]}_{j}"
            items.append(
                GenerateItem(
                    rid,
                    prompt,
                    sampling,
                    _bool(return_logprob[i], "return_logprob"),
                    skip_special,
                    routes,
                )
            )
    if len(set(ns)) > 1:
        raise BadRequest("n must be the same for every prompt of a batch")
    return ParsedGenerate(
        items=items,
        single=single and ns[0] == 1,
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
    )


def generate_answer(
    item: GenerateItem,
    *,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: FinishReason,
    weight_version: str,
    text: str,
    token_texts: Sequence[str | None] | None,
    e2e_latency_s: float,
    routed_experts: np.ndarray | None = None,
) -> dict[str, Any]:
    """One result object of the ``/generate`` answer, as SGLang writes it (``routed_experts``
    only when the item asked and the sequence ran)."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish_reason_to_json(finish_reason),
        "prompt_tokens": len(item.prompt_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": e2e_latency_s,
    }
    if item.return_logprob:
        texts = token_texts if token_texts is not None else [None] * len(output_ids)
        meta["output_token_logprobs"] = [
            [float(lp), int(tok), t] for lp, tok, t in zip(logprobs, output_ids, texts)
        ]
    if item.return_routed_experts and routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(routed_experts)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def _prompts(
    body: dict[str, Any], encode: Callable[[str], list[int]] | None
) -> tuple[list[tuple[int, ...]], bool]:
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequest("give exactly one of input_ids and text")
    if text is not None:
        if encode is None:
            raise BadRequest("text input needs a tokenizer, which this server has none of")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        return [tuple(encode(t)) for t in texts], isinstance(text, str)
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or of such lists)")
    single = not isinstance(input_ids[0], list)
    prompts = [input_ids] if single else input_ids
    for i, prompt in enumerate(prompts):
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(_is_int(t) and t >= 0 for t in prompt)
        ):
            raise BadRequest(f"input_ids[{i}] must be a non-empty list of token ids")
    return [tuple(p) for p in prompts], single


def _per_prompt(value: Any, num: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise BadRequest(f"{name} has {len(value)} entries for {num} prompts")
        return [default if v is None else v for v in value]
    return [value] * num


def _rids(rid: Any, num: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(rid, str):
        return [rid] if num == 1 else [f"{rid}_{i}" for i in range(num)]
    if isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) for r in rid):
        return list(rid)
    raise BadRequest(f"rid must be a string or a list of {num} strings")


def _sampling(params: Any, where: str) -> tuple[SamplingParams, int, bool]:
    prefix = f"{where}." if where else "sampling_params."
    if not isinstance(params, dict):
        raise BadRequest(f"{prefix[:-1]} must be an object")
    for key, value in params.items():
        if key not in SGLANG_SAMPLING_FIELDS:
            expected = ", ".join(f"`{f}`" for f in SGLANG_SAMPLING_FIELDS)
            raise BadRequest(f"unknown field `{key}`, expected one of {expected}")
        if key in _UNSUPPORTED_DEFAULTS and value not in _UNSUPPORTED_DEFAULTS[key]:
            raise BadRequest(f"{prefix}{key}={value!r} is not supported by the embedded server")

    def get(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value

    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise BadRequest(f"{prefix}stop_token_ids must be a list of token ids")
    seed = params.get("sampling_seed")
    try:
        sampling = SamplingParams(
            max_new_tokens=_int(get("max_new_tokens", 128), prefix + "max_new_tokens"),
            temperature=_float(get("temperature", 1.0), prefix + "temperature"),
            top_p=_float(get("top_p", 1.0), prefix + "top_p"),
            top_k=_int(get("top_k", -1), prefix + "top_k"),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_bool(get("ignore_eos", False), prefix + "ignore_eos"),
            seed=None if seed is None else _int(seed, prefix + "sampling_seed"),
        )
    except ValueError as err:
        raise BadRequest(f"{prefix[:-1]}: {err}") from err
    n = _int(get("n", 1), prefix + "n")
    if n < 1:
        raise BadRequest(f"{prefix}n must be >= 1, got {n}")
    return sampling, n, _bool(get("skip_special_tokens", True), prefix + "skip_special_tokens")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v: Any, name: str) -> int:
    if not _is_int(v):
        raise BadRequest(f"{name} must be an integer, got {v!r}")
    return v


def _float(v: Any, name: str) -> float:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise BadRequest(f"{name} must be a number, got {v!r}")
    return float(v)


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}")
    return v
