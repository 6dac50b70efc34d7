"""SGLang's native ``/generate`` JSON, to and from the rollout types: pure functions.

The request asks for what slime asks for: token ids in, ``return_logprob``
with ``logprob_start_len: -1`` (output tokens only) and ``no_stop_trim`` (a
matched stop token stays in ``output_ids``). The client sends a prompt's group in one
request (SGLang's batch form), each sample with its own ``rid`` to abort and its own
``sampling_seed``.

Routed experts (rollout routing replay, R3), as SGLang implements them (files under its
``python/sglang/``):

- the server must run with ``--enable-return-routed-experts``
  (``srt/server_args.py``), and a request asks with ``"return_routed_experts": true``:
  one bool even in the batch form, copied to every item by
  ``GenerateReqInput.__getitem__`` (``srt/managers/io_struct.py``);
- ``meta_info.routed_experts`` is base64 of the C-order bytes of an int32 array
  ``[positions, num_hidden_layers, num_experts_per_tok]``
  (``srt/managers/tokenizer_manager.py``: ``pybase64.b64encode(tensor.numpy().tobytes())``,
  native byte order, which is little-endian on every host SGLang runs on). A layer without
  a router (a dense layer) never writes its entries, which stay as the zeroed buffer has them;
- the positions are ``[0, seqlen - 1)``, seqlen = len(input_ids) + len(output_ids): every
  input token and every output token but the last, which is never forwarded
  (``RoutedExpertsCapturer.get_routed_experts``, ``req_to_token[: seqlen - 1]``, in
  ``srt/layers/moe/routed_experts_capturer.py``, called by the scheduler's
  ``maybe_collect_routed_experts``). Row t holds the experts that token t went to;
- newer releases take ``routed_experts_start_len`` (in [0, prompt tokens]; default 0) and
  return only rows ``[start_len, seqlen - 1)``. It is not sent here: a resumed sample's
  request has all its tokens so far as input, so the full rows are what it needs;
- a request aborted before it ran answers without the field.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    rid: str,
    seed: int | None,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """The ``/generate`` body for one sample of one prompt."""
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_to_json(sampling, seed=seed),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def build_batch_payload(
    items: Sequence[tuple[Sequence[int], SamplingParams, str, int | None]],
    *,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """The ``/generate`` body for several samples at once, ``(input_ids, sampling, rid, seed)``
    each: SGLang's batch form (lists of ``input_ids``, ``sampling_params`` and ``rid``),
    answered by a list in the same order."""
    payload: dict[str, Any] = {
        "rid": [rid for _, _, rid, _ in items],
        "input_ids": [list(ids) for ids, _, _, _ in items],
        "sampling_params": [sampling_params_to_json(s, seed=seed) for _, s, _, seed in items],
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def parse_batch_response(
    value: Any,
    count: int,
    *,
    num_layers: int | None = None,
    input_lengths: Sequence[int] | None = None,
) -> list[GenerateResult]:
    """The ``count`` answers of a batch request, in order; with ``num_layers``, each
    answer's routed experts too, for inputs of ``input_lengths`` tokens."""
    if isinstance(value, dict) and count == 1:
        value = [value]
    if not isinstance(value, list) or len(value) != count:
        raise RolloutProtocolError(f"expected a list of {count} results, got {_preview(value)}")
    if num_layers is None:
        return [parse_generate_response(v) for v in value]
    if input_lengths is None or len(input_lengths) != count:
        raise ValueError(f"num_layers needs the input lengths of all {count} requests")
    return [
        parse_generate_response(v, num_layers=num_layers, num_input_tokens=n)
        for v, n in zip(value, input_lengths)
    ]


def encode_routed_experts(array: np.ndarray) -> str:
    """SGLang's ``meta_info.routed_experts`` of an int array ``[positions, layers, topk]``."""
    if array.ndim != 3:
        raise ValueError(f"routed experts must be [positions, layers, topk], got {array.shape}")
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(value: Any, *, num_tokens: int, num_layers: int) -> np.ndarray:
    """The int32 array ``[num_tokens, num_layers, topk]`` of ``meta_info.routed_experts``;
    topk is what the size gives. Raises RolloutProtocolError when the value is not base64
    of whole int32s, or their number is not ``num_tokens * num_layers * topk`` for a topk >= 1
    (no positions: the value must be empty, and topk is 0)."""
    if not isinstance(value, str):
        raise RolloutProtocolError(f"routed_experts is not a base64 string: {_preview(value)}")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error as err:
        raise RolloutProtocolError(f"routed_experts is not valid base64: {err}") from err
    if len(raw) % 4:
        raise RolloutProtocolError(f"routed_experts has {len(raw)} bytes, not whole int32s")
    count, per_topk = len(raw) // 4, num_tokens * num_layers
    if (count == 0) != (per_topk == 0) or (per_topk and count % per_topk):
        raise RolloutProtocolError(
            f"routed_experts has {count} int32 values, which is not {num_tokens} positions x "
            f"{num_layers} layers x topk for any topk >= 1"
        )
    topk = count // per_topk if per_topk else 0
    return np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(num_tokens, num_layers, topk)


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
    routed_experts: np.ndarray | None = field(default=None, compare=False, repr=False)
    """int32 ``[input + output tokens - 1, layers, topk]``: the experts each token went to
    (see the module docstring); None when not asked for, or the request was aborted before
    it ran."""


def parse_generate_response(
    value: Any, *, num_layers: int | None = None, num_input_tokens: int | None = None
) -> GenerateResult:
    """Read one sample's answer; a one-element list (a batch of one) is accepted too.

    With ``num_layers`` the routed experts of its ``num_input_tokens`` input tokens and
    output tokens are read too (``decode_routed_experts``).

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
    finish = finish_reason_from_json(meta.get("finish_reason"))
    routes = None
    if num_layers is not None:
        if num_input_tokens is None:
            raise ValueError("num_layers needs num_input_tokens: the routes cover the input")
        routes = _routed_experts(meta, finish, num_input_tokens + len(output_ids) - 1, num_layers)
    return GenerateResult(
        output_ids=tuple(int(t) for t in output_ids),
        logprobs=tuple(logprobs),
        finish_reason=finish,
        weight_version=None if version is None else str(version),
        routed_experts=routes,
    )


def _routed_experts(
    meta: dict[str, Any], finish: FinishReason, num_tokens: int, num_layers: int
) -> np.ndarray | None:
    """The answer's routes; None only for a request aborted before it ran (SGLang sends
    none then)."""
    value = meta.get("routed_experts")
    if value is None:
        if finish.type == "abort":
            return None
        raise RolloutProtocolError(
            "the server did not return routed_experts (meta_info.routed_experts is missing): "
            "was it started without --enable-return-routed-experts, or does it serve a "
            "model without mixture-of-experts layers?"
        )
    return decode_routed_experts(value, num_tokens=num_tokens, num_layers=num_layers)


def _preview(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
