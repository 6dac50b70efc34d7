"""The /generate JSON both ways, checked against SGLang's own contract (sglang==0.5.23).

These tests fail, never skip, without the contract file: fetch it with
``python -m megatron_grpo.testing.sglang_contract`` (``scripts/setup_env.sh`` does).
"""

import pytest

from megatron_grpo.embedded.protocol import BadRequest, generate_answer, parse_generate_body
from megatron_grpo.sglang_api.errors import RolloutProtocolError
from megatron_grpo.sglang_api.protocol import (
    build_generate_payload,
    finish_reason_from_json,
    finish_reason_to_json,
    parse_generate_response,
)
from megatron_grpo.sglang_api.types import FinishReason, RolloutRequest, SamplingParams
from megatron_grpo.testing import sglang_contract as contract

pytestmark = pytest.mark.timeout(60)


def test_client_payload_satisfies_sglang_contract():
    sampling = SamplingParams(
        max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(3, 4), seed=5
    )
    payload = build_generate_payload([1, 2, 3], sampling, rid="r-1", seed=11)
    decoded = contract.validate_request(payload)
    assert decoded.input_ids == [1, 2, 3]
    assert decoded.return_logprob is True and decoded.logprob_start_len == -1
    params = decoded.sampling_params
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (
        7,
        0.7,
        0.9,
        20,
    )
    assert params.stop_token_ids == [3, 4] and params.sampling_seed == 11
    assert params.no_stop_trim is True and params.n == 1
    unseeded = build_generate_payload([1], SamplingParams(), rid="r-2", seed=None)
    assert contract.validate_request(unseeded).sampling_params.sampling_seed is None


def test_contract_rejects_unknown_sampling_field():
    with pytest.raises(contract.ContractViolation, match="unknown field `foo`"):
        contract.validate_request({"input_ids": [1], "sampling_params": {"foo": 1}})


def test_every_sample_gets_its_own_seed():
    request = RolloutRequest(prompts=((1,), (2,)), num_samples=3, sampling=SamplingParams(seed=100))
    seeds = {request.sample_seed(p, s) for p in range(2) for s in range(3)}
    assert seeds == set(range(100, 106))
    assert RolloutRequest(prompts=((1,),)).sample_seed(0, 0) is None


@pytest.mark.parametrize(
    "kwargs", [{"max_new_tokens": -1}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_k": 0}]
)
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def _answer(output_ids, logprobs, finish):
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": "x",
            "finish_reason": finish,
            "weight_version": "3",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
        },
    }


def test_parse_response():
    value = _answer([5, 6], [-0.5, -1.5], {"type": "stop", "matched": 6})
    contract.validate_response(value)
    for form in (value, [value]):
        result = parse_generate_response(form)
        assert result.output_ids == (5, 6) and result.logprobs == (-0.5, -1.5)
        assert result.finish_reason == FinishReason(type="stop", detail=6)
        assert result.weight_version == "3"


def test_parse_response_rejects_mismatched_logprobs():
    value = _answer([5, 6], [-0.5, -1.5], {"type": "length", "length": 2})
    value["meta_info"]["output_token_logprobs"][1][1] = 7
    with pytest.raises(RolloutProtocolError, match="does not match token 6"):
        parse_generate_response(value)
    del value["meta_info"]["output_token_logprobs"]
    with pytest.raises(RolloutProtocolError, match="return_logprob"):
        parse_generate_response(value)


@pytest.mark.parametrize(
    "reason",
    [
        FinishReason(type="stop", detail=7),
        FinishReason(type="length", detail=16),
        FinishReason(type="abort", detail="Aborted"),
    ],
)
def test_finish_reason_round_trip_satisfies_contract(reason):
    as_json = finish_reason_to_json(reason)
    assert finish_reason_from_json(as_json) == reason
    contract.validate_response(_answer([], [], as_json))


def test_server_reads_what_the_client_sends():
    sampling = SamplingParams(max_new_tokens=9, temperature=0.5, top_k=4, stop_token_ids=(2,))
    body = build_generate_payload([1, 2, 3], sampling, rid="abc", seed=42)
    parsed = parse_generate_body(body, encode=None)
    assert parsed.single
    [item] = parsed.items
    assert item.rid == "abc" and item.prompt_ids == (1, 2, 3) and item.return_logprob
    assert item.sampling == SamplingParams(
        max_new_tokens=9, temperature=0.5, top_k=4, stop_token_ids=(2,), seed=42
    )


def test_server_accepts_sglang_default_sampling_params():
    defaults = contract.load_contract().SamplingParams().to_json_value()
    parsed = parse_generate_body({"input_ids": [1], "sampling_params": defaults}, encode=None)
    assert parsed.items[0].sampling.max_new_tokens == 128


def test_server_batch_and_n_expand_prompt_major():
    body = {
        "input_ids": [[1, 2], [3]],
        "sampling_params": [{"n": 2, "temperature": 0}, {"n": 2, "max_new_tokens": 3}],
        "rid": "b",
        "return_logprob": [True, False],
        "routed_by_router": "ignored",  # unknown top-level keys are ignored
    }
    parsed = parse_generate_body(body, encode=None)
    assert not parsed.single
    assert [i.rid for i in parsed.items] == ["b_0_0", "b_0_1", "b_1_0", "b_1_1"]
    assert [i.prompt_ids for i in parsed.items] == [(1, 2), (1, 2), (3,), (3,)]
    assert [i.return_logprob for i in parsed.items] == [True, True, False, False]
    assert parsed.items[2].sampling.max_new_tokens == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1], "sampling_params": {"foo": 1}}, "unknown field `foo`, expected"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, "min_p=0.1 is not supported"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "stop=.* is not supported"),
        ({"input_ids": [1], "sampling_params": {"top_k": "5"}}, "top_k must be an integer"),
        ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p must be in"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len=0"),
        ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num=5"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [1, -2]}, r"input_ids\[0\]"),
        ({"text": "hello"}, "tokenizer"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries for 2 prompts"),
        ([1, 2], "JSON object"),
    ],
)
def test_server_rejects_what_it_cannot_serve(body, message):
    with pytest.raises(BadRequest, match=message):
        parse_generate_body(body, encode=None)


def test_server_answer_satisfies_contract():
    [item] = parse_generate_body({"input_ids": [1, 2], "return_logprob": True}, encode=None).items
    answer = generate_answer(
        item,
        output_ids=[4, 5],
        logprobs=[-1.0, -2.0],
        finish_reason=FinishReason(type="stop", detail=5),
        weight_version="7",
        text="",
        token_texts=None,
        e2e_latency_s=0.1,
    )
    [decoded] = contract.validate_response(answer)
    assert decoded.meta_info.weight_version == "7"
    assert [e.token_id for e in decoded.meta_info.output_token_logprobs] == [4, 5]
