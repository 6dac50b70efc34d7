"""Routed experts (R3): SGLang's ``meta_info.routed_experts`` both ways, and the embedded
engine's, checked against the top-k of one plain transformers forward of the same weights.

SGLang's format (``megatron_grpo.sglang_api.protocol``): base64 of little-endian int32
``[input + output tokens - 1, layers, topk]``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from megatron_grpo.embedded.decode import SequenceSpec, generate_batch
from megatron_grpo.embedded.protocol import BadRequest, parse_generate_body
from megatron_grpo.embedded.server import start_embedded_server
from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.rollout.partial import Partial
from megatron_grpo.sglang_api.errors import RolloutProtocolError
from megatron_grpo.sglang_api.protocol import (
    GenerateResult,
    build_batch_payload,
    build_generate_payload,
    decode_routed_experts,
    encode_routed_experts,
    parse_batch_response,
    parse_generate_response,
)
from megatron_grpo.sglang_api.types import FinishReason, Generation, RolloutRequest, SamplingParams
from megatron_grpo.testing import random_hf_model, tiny_hf_config

pytestmark = pytest.mark.timeout(120)

NUM_LAYERS, TOP_K, DENSE_LAYER = 3, 2, 1
STOP = FinishReason(type="stop", detail=9)


# ---- the format ----


def test_routes_are_base64_of_little_endian_int32_in_c_order():
    routes = np.array([[[1, 2]], [[3, 258]]], dtype=np.int32)  # 2 positions, 1 layer, top-2
    text = encode_routed_experts(routes)
    raw = bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 2, 1, 0, 0])
    assert text == "AQAAAAIAAAADAAAAAgEAAA==" and np.frombuffer(raw, "<i4").tolist() == [
        1,
        2,
        3,
        258,
    ]
    back = decode_routed_experts(text, num_tokens=2, num_layers=1)
    assert back.dtype == np.int32 and back.shape == (2, 1, 2)
    np.testing.assert_array_equal(back, routes)


def test_decode_takes_topk_from_the_size():
    routes = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)
    back = decode_routed_experts(encode_routed_experts(routes), num_tokens=4, num_layers=3)
    np.testing.assert_array_equal(back, routes)
    empty = decode_routed_experts("", num_tokens=0, num_layers=3)
    assert empty.shape == (0, 3, 0)


@pytest.mark.parametrize(
    "value, message",
    [
        (
            encode_routed_experts(np.zeros((1, 1, 5), np.int32)),
            "has 5 int32 values, which is not 2",
        ),
        (
            encode_routed_experts(np.zeros((3, 1, 1), np.int32)),
            "has 3 int32 values, which is not 2",
        ),
        ("", "has 0 int32 values, which is not 2 positions x 1 layers"),
        ("AQAA", "has 3 bytes, not whole int32s"),
        ("not base64!", "is not valid base64"),
        ([1, 2], "is not a base64 string"),
    ],
)
def test_decode_names_what_does_not_fit(value, message):
    with pytest.raises(RolloutProtocolError, match=message):
        decode_routed_experts(value, num_tokens=2, num_layers=1)


def test_payloads_ask_for_routes_only_when_told():
    sampling = SamplingParams(max_new_tokens=4)
    plain = build_generate_payload([1, 2], sampling, rid="r", seed=3)
    assert "return_routed_experts" not in plain
    asked = build_generate_payload([1, 2], sampling, rid="r", seed=3, return_routed_experts=True)
    assert asked == plain | {"return_routed_experts": True}
    items = [([1, 2], sampling, "a", 1), ([3], sampling, "b", 2)]
    batch = build_batch_payload(items)
    assert "return_routed_experts" not in batch
    assert build_batch_payload(items, return_routed_experts=True) == batch | {
        "return_routed_experts": True  # one bool for the whole batch, as SGLang takes it
    }


def _answer(output_ids, finish, routes=None):
    meta = {
        "finish_reason": finish,
        "weight_version": "1",
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
    }
    if routes is not None:
        meta["routed_experts"] = encode_routed_experts(routes)
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_parse_reads_routes_of_input_plus_output_minus_one_positions():
    routes = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)  # 3 input + 2 output - 1
    value = _answer([7, 9], {"type": "stop", "matched": 9}, routes)
    parsed = parse_generate_response(value, num_layers=2, num_input_tokens=3)
    np.testing.assert_array_equal(parsed.routed_experts, routes)
    assert parse_generate_response(value).routed_experts is None  # not asked: not read
    with pytest.raises(RolloutProtocolError, match="which is not 5 positions x 2 layers"):
        parse_generate_response(value, num_layers=2, num_input_tokens=4)
    (batched,) = parse_batch_response([value], 1, num_layers=2, input_lengths=[3])
    np.testing.assert_array_equal(batched.routed_experts, routes)


def test_an_answer_without_routes_is_an_error_unless_aborted_before_it_ran():
    value = _answer([7], {"type": "length", "length": 1})
    with pytest.raises(RolloutProtocolError, match="without --enable-return-routed-experts"):
        parse_generate_response(value, num_layers=2, num_input_tokens=3)
    aborted = _answer([], {"type": "abort", "message": "Aborted"})
    assert parse_generate_response(aborted, num_layers=2, num_input_tokens=3).routed_experts is None


def test_generation_checks_its_routes_cover_every_token_but_the_last():
    def generation(num_positions):
        return Generation(
            prompt_index=0,
            sample_index=0,
            prompt_ids=(1, 2, 3),
            output_ids=(4, 5),
            rollout_logprobs=(-1.0, -1.0),
            finish_reason=STOP,
            weight_version="1",
            routed_experts=np.zeros((num_positions, 2, 2), np.int32),
        )

    assert generation(4).routed_experts.shape == (4, 2, 2)
    with pytest.raises(ValueError, match="so 4 routed positions, but routed_experts of shape"):
        generation(5)


def test_client_config_wants_the_layer_count_with_routes():
    with pytest.raises(ValueError, match="return_routed_experts needs num_layers >= 1"):
        ClientConfig(urls=("http://x",), return_routed_experts=True)
    assert ClientConfig(urls=("http://x",), return_routed_experts=True, num_layers=2).num_layers


def test_the_embedded_server_reads_one_flag_for_the_batch():
    body = {"input_ids": [[1, 2], [3]], "return_routed_experts": True}
    assert all(i.return_routed_experts for i in parse_generate_body(body, encode=None).items)
    assert not parse_generate_body({"input_ids": [1]}, encode=None).items[0].return_routed_experts
    for bad, message in [
        ({"return_routed_experts": [True]}, "return_routed_experts must be true or false"),
        ({"routed_experts_start_len": 1}, "routed_experts_start_len=1 is not supported"),
    ]:
        with pytest.raises(BadRequest, match=message):
            parse_generate_body({"input_ids": [1]} | bad, encode=None)


def test_a_resumed_sample_keeps_its_latest_segments_routes():
    """Segment 1: 3 prompt tokens in, 2 out (4 routed positions); the weight update cuts it.
    Segment 2: those 5 tokens in, 3 out (7 positions). The sample's routes are segment 2's."""
    first, second = (np.full((n, 1, 2), n, np.int32) for n in (4, 7))
    partial = Partial(sample_index=0)
    abort = FinishReason(type="abort", detail="pause")
    partial.add(GenerateResult((4, 5), (-1.0, -1.0), abort, "1", routed_experts=first))
    partial.add(GenerateResult((), (), abort, "1"))  # aborted again before it ran: no routes
    partial.add(GenerateResult((6, 7, 9), (-1.0,) * 3, STOP, "2", routed_experts=second))
    sample = partial.generation(0, (1, 2, 3), STOP, "2")
    assert sample.routed_experts is second and sample.routed_experts.shape[0] == 3 + 5 - 1


# ---- the embedded engine, against a plain forward ----


@pytest.fixture(scope="module")
def moe_model():
    """Tiny Qwen3-MoE, 4 experts top-2, whose middle layer is dense."""
    config = tiny_hf_config(
        "qwen3_moe",
        num_hidden_layers=NUM_LAYERS,
        mlp_only_layers=[DENSE_LAYER],
        max_position_embeddings=256,
    )
    return random_hf_model(config, seed=3)


def reference_routes(model, tokens):
    """Each router's top-k over ``tokens`` by one forward, no cache and no padding: the ids
    ``[len(tokens), layers, topk]`` (a dense layer's 0) and the router logits that chose them."""
    ids = torch.zeros(len(tokens), NUM_LAYERS, TOP_K, dtype=torch.int32)
    logits = torch.zeros(len(tokens), NUM_LAYERS, model.config.num_experts)
    hooks = []
    for layer, block in enumerate(model.model.layers):
        if layer == DENSE_LAYER:
            assert not hasattr(block.mlp, "gate")
            continue

        def keep(module, args, _output, layer=layer):
            scores = torch.nn.functional.linear(args[0].reshape(len(tokens), -1), module.weight)
            logits[:, layer] = scores
            ids[:, layer] = torch.topk(scores, TOP_K, dim=-1).indices.to(torch.int32)

        hooks.append(block.mlp.gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([list(tokens)]))
    finally:
        for hook in hooks:
            hook.remove()
    return ids.numpy(), logits


def assert_routes_match(model, prompt, output, routes):
    """Routes cover prompt + output[:-1] and pick, at every position and layer, the experts
    of the plain forward (as sets; a differing pick only on a float near-tie)."""
    tokens = list(prompt) + list(output)[:-1]
    expected, logits = reference_routes(model, tokens)
    assert routes.dtype == np.int32 and routes.shape == (len(tokens), NUM_LAYERS, TOP_K)
    got, want = np.sort(routes, axis=-1), np.sort(expected, axis=-1)
    for position, layer in zip(*np.nonzero((got != want).any(axis=-1))):
        top = torch.sort(logits[position, layer], descending=True).values
        gap = float(top[TOP_K - 1] - top[TOP_K])
        assert gap < 1e-4, (position, layer, got[position, layer], want[position, layer], gap)
    assert (routes[:, DENSE_LAYER] == 0).all()


def test_a_batch_of_left_padded_rows_returns_each_rows_routes(moe_model):
    """One batch: prompts of 7, 2 and 4 tokens (left padding), two samples of one prompt (one
    shared prefill), rows that stop at different steps (riding along, then dropped), a row
    that did not ask for routes."""
    sampling = SamplingParams(
        max_new_tokens=8, temperature=1.0, stop_token_ids=tuple(range(0, 200, 7))
    )
    prompts = [(5, 6, 7, 8, 9, 10, 11), (20, 21), (30, 31, 32, 33), (20, 21)]
    specs = [
        SequenceSpec(prompt_ids=p, sampling=sampling, seed=40 + i, return_routed_experts=i != 2)
        for i, p in enumerate(prompts)
    ]
    done = generate_batch(moe_model, specs, eos_token_ids=frozenset())
    lengths = [len(d.output_ids) for d in done]
    assert len(set(lengths)) > 1, lengths  # rows ended at different steps
    for spec, row in zip(specs, done, strict=True):
        if not spec.return_routed_experts:
            assert row.routed_experts is None
            continue
        assert_routes_match(moe_model, spec.prompt_ids, row.output_ids, row.routed_experts)


def test_a_group_request_carries_each_samples_routes(moe_model):
    """Through the client and the embedded server: the batch form, two samples a prompt."""
    handle = start_embedded_server(moe_model, seed=0)
    try:
        request = RolloutRequest(
            prompts=((5, 6, 7, 8, 9), (40, 41)),
            num_samples=2,
            sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=11),
        )
        config = ClientConfig(urls=(handle.url,), return_routed_experts=True, num_layers=NUM_LAYERS)

        async def run():
            async with SGLangClient(config) as client:
                return await client.generate(request)

        samples = asyncio.run(run())
    finally:
        handle.stop()
    assert len(samples) == 4
    for sample in samples:
        assert sample.routed_experts is not None
        assert sample.routed_experts.shape[0] == len(sample.prompt_ids) + len(sample.output_ids) - 1
        assert_routes_match(moe_model, sample.prompt_ids, sample.output_ids, sample.routed_experts)


def post(url, body):
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_sample_resumed_from_its_tokens_so_far_has_routes_over_all_of_them(moe_model):
    """Segment 1 generates 3 tokens; segment 2 goes on from prompt + those 3, as the client
    resends a sample a weight update cut. Its routes cover prompt + all output - 1."""
    prompt = (50, 51, 52, 53)
    handle = start_embedded_server(moe_model, seed=0)
    partial = Partial(sample_index=0)
    try:
        for k, budget in enumerate((3, 4)):
            ids = prompt + tuple(partial.output)
            sampling = SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True)
            payload = build_batch_payload(
                [(ids, sampling, f"r{k}", 5 + k)], return_routed_experts=True
            )
            status, answer = post(handle.url, payload)
            assert status == 200, answer
            (result,) = parse_batch_response(
                answer, 1, num_layers=NUM_LAYERS, input_lengths=[len(ids)]
            )
            partial.add(result)
    finally:
        handle.stop()
    sample = partial.generation(0, prompt, result.finish_reason, result.weight_version)
    assert len(sample.output_ids) == 7 and len(sample.version_spans) == 2
    assert sample.routed_experts is not None and sample.routed_experts.shape[0] == 4 + 7 - 1
    assert_routes_match(moe_model, prompt, sample.output_ids, sample.routed_experts)


def test_a_dense_model_refuses_routes_by_name():
    handle = start_embedded_server(random_hf_model(tiny_hf_config("qwen2")), seed=0)
    try:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        status, answer = post(handle.url, body | {"return_routed_experts": True})
        plain_status, _ = post(handle.url, body)
    finally:
        handle.stop()
    assert status == 400 and plain_status == 200
    assert "served model (Qwen2ForCausalLM) has no mixture-of-experts layers" in answer["error"]
