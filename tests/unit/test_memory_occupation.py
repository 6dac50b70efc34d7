"""/release_memory_occupation and /resume_memory_occupation: the request body, the client's
calls, and the embedded server's state machine (in a thread, on a tiny model). The resident
set of a server process asleep is measured in tests/e2e/test_engine_asleep.py."""

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from aiohttp import web
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_grpo.embedded.memory_routes import WEIGHT_PATHS
from megatron_grpo.embedded.server import start_embedded_server
from megatron_grpo.embedded.weights import hf_weights, tensor_update
from megatron_grpo.rollout.client_config import ClientConfig
from megatron_grpo.rollout.engine_calls import EngineCalls
from megatron_grpo.sglang_api.errors import RolloutHTTPError, RolloutTimeoutError
from megatron_grpo.sglang_api.memory import ALL_TAGS, KV_CACHE, WEIGHTS, memory_body

pytestmark = pytest.mark.timeout(120)

GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,  # peaked logits: no near-ties in greedy decoding
    )
    return Qwen2ForCausalLM(config).eval()


def post(url: str, path: str, body: dict) -> tuple[int, dict | list | None]:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def message(answer) -> str:
    return answer["error"]["message"]


@pytest.fixture
def server():
    handle = start_embedded_server(tiny_model())
    yield handle
    handle.stop()


def calls_to(*urls: str, **overrides) -> EngineCalls:
    return EngineCalls(ClientConfig(urls=urls, **overrides))


def test_the_body_names_the_tags_and_none_means_every_tag():
    assert memory_body(None) == {}
    assert memory_body([WEIGHTS]) == {"tags": ["weights"]}
    assert memory_body(("weights", "kv_cache", "weights")) == {"tags": ["weights", "kv_cache"]}
    assert ALL_TAGS == ("kv_cache", "weights", "cuda_graph")
    with pytest.raises(ValueError, match="pass None for every tag"):
        memory_body([])
    with pytest.raises(ValueError, match=r"unknown memory tag\(s\) \['weight'\]"):
        memory_body(["weight"])
    with pytest.raises(ValueError, match="not the string"):
        memory_body("weights")


def test_asleep_the_engine_refuses_generation_and_weights_by_name(server):
    status, before = post(server.url, "/generate", GREEDY)
    assert status == 200
    assert post(server.url, "/release_memory_occupation", {"tags": [WEIGHTS, KV_CACHE]}) == (
        200,
        None,
    )
    assert all(p.numel() == 0 for p in server.engine.model.parameters())

    status, answer = post(server.url, "/generate", GREEDY)
    assert status == 400
    assert "kv_cache and weights memory is released" in message(answer)
    assert "/resume_memory_occupation first" in message(answer)
    for path in sorted(WEIGHT_PATHS):
        status, answer = post(server.url, path, {})
        assert status == 400, path
        assert message(answer).startswith(f"{path} refused: the engine's weights memory")

    status, answer = post(server.url, "/release_memory_occupation", {"tags": [WEIGHTS]})
    assert (status, message(answer)) == (
        400,
        "/release_memory_occupation: weights already released; /resume_memory_occupation first",
    )
    with urllib.request.urlopen(f"{server.url}/health_generate", timeout=10) as reply:
        assert reply.status == 200  # asleep is alive

    # Weights back, the KV cache still asleep: weight calls pass, generation waits.
    assert post(server.url, "/resume_memory_occupation", {"tags": [WEIGHTS]}) == (200, None)
    assert post(server.url, "/get_weights_by_name", {"name": "model.norm.weight"})[0] == 200
    status, answer = post(server.url, "/generate", GREEDY)
    assert status == 400
    assert "the engine's kv_cache memory is released" in message(answer)
    status, answer = post(server.url, "/resume_memory_occupation", {"tags": [WEIGHTS]})
    assert (status, message(answer)) == (
        400,
        "/resume_memory_occupation: weights not released (released: kv_cache)",
    )
    assert post(server.url, "/resume_memory_occupation", {"tags": [KV_CACHE]}) == (200, None)
    status, zeros = post(server.url, "/generate", GREEDY)
    assert status == 200
    assert zeros["output_ids"] == [0] * 6  # resumed weights are zeros until a push
    assert before["output_ids"] != zeros["output_ids"]


def test_resume_then_push_gives_the_same_tokens(server):
    weights = {k: v.detach().clone() for k, v in hf_weights(server.engine.model).items()}
    before = post(server.url, "/generate", GREEDY)[1]

    async def scenario():
        async with calls_to(server.url) as calls:
            await calls.release_memory_occupation()
            assert server.engine.released_tags == ALL_TAGS
            await calls.resume_memory_occupation([WEIGHTS])
            await calls.begin_weight_update()
            update = tensor_update(weights, weight_version="pushed")
            await calls.update_weights_from_tensor(update, url=server.url)
            await calls.end_weight_update()
            await calls.resume_memory_occupation(["kv_cache", "cuda_graph"])

    asyncio.run(scenario())
    after = post(server.url, "/generate", GREEDY)[1]
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == "pushed"


def test_a_push_into_released_weights_is_refused_with_the_state_and_url(server):
    update = tensor_update(hf_weights(server.engine.model), weight_version="late")

    async def scenario():
        async with calls_to(server.url) as calls:
            await calls.release_memory_occupation([WEIGHTS])
            await calls.begin_weight_update()
            with pytest.raises(RolloutHTTPError) as refused:
                await calls.update_weights_from_tensor(update, url=server.url)
            await calls.end_weight_update()
            with pytest.raises(RolloutHTTPError) as twice:
                await calls.release_memory_occupation([WEIGHTS])
            return refused.value, twice.value

    refused, twice = asyncio.run(scenario())
    assert refused.status == 400
    assert server.url in str(refused)
    assert "/update_weights_from_tensor refused: the engine's weights memory is released" in str(
        refused
    )
    assert server.url in str(twice) and "weights already released" in str(twice)
    assert server.engine.weight_version == "default"


def test_release_while_a_request_runs_is_refused_until_generation_pauses(server):
    long_run = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4000, "temperature": 0}}

    async def scenario():
        async with calls_to(server.url) as calls:
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(None, post, server.url, "/generate", long_run)
            while server.engine.num_running == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(RolloutHTTPError) as busy:
                await calls.release_memory_occupation()
            await calls.pause_generation("abort")
            await calls.release_memory_occupation()
            status, aborted = await running
            return busy.value, status, aborted

    busy, status, aborted = asyncio.run(scenario())
    assert "while 1 sequence(s) run and 0 wait" in str(busy)
    assert "pause_generation first" in str(busy)
    assert status == 200 and aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.engine.released_tags == ALL_TAGS


def test_a_request_queued_while_paused_waits_for_the_resume(server):
    """SGLang releases with requests waiting behind a pause; they run once awake."""

    async def scenario():
        async with calls_to(server.url) as calls:
            await calls.pause_generation("abort")
            loop = asyncio.get_running_loop()
            queued = loop.run_in_executor(None, post, server.url, "/generate", GREEDY)
            while server.engine.num_queued == 0:
                await asyncio.sleep(0.01)
            await calls.release_memory_occupation()
            await calls.continue_generation()
            await asyncio.sleep(0.3)
            assert server.engine.num_queued == 1  # not started on released memory
            await calls.resume_memory_occupation()
            return await queued

    status, answer = asyncio.run(scenario())
    assert status == 200
    assert answer["output_ids"] == [0] * 6  # ran on the resumed (zero) weights


def test_the_client_fans_out_to_every_server():
    first, second = start_embedded_server(tiny_model(1)), start_embedded_server(tiny_model(2))
    try:

        async def scenario():
            async with calls_to(first.url, second.url) as calls:
                await calls.release_memory_occupation([KV_CACHE])
                released = first.engine.released_tags, second.engine.released_tags
                await calls.resume_memory_occupation([KV_CACHE])
                return released

        assert asyncio.run(scenario()) == ((KV_CACHE,), (KV_CACHE,))
        assert first.engine.released_tags == second.engine.released_tags == ()
    finally:
        first.stop()
        second.stop()


@contextlib.asynccontextmanager
async def hanging_release():
    """A server whose /release_memory_occupation never answers."""

    async def hang(request):
        await asyncio.sleep(3600)
        return web.json_response(None)

    app = web.Application()
    app.router.add_post("/release_memory_occupation", hang)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_a_release_that_does_not_finish_in_time_names_the_transition_and_url():
    async def scenario():
        async with hanging_release() as url:
            async with calls_to(url, control_timeout_s=0.3) as calls:
                start = time.monotonic()
                with pytest.raises(RolloutTimeoutError) as late:
                    await calls.release_memory_occupation([WEIGHTS])
                return url, late.value, time.monotonic() - start

    url, late, waited = asyncio.run(scenario())
    assert str(late) == f"{url}/release_memory_occupation took longer than 0.3 s"
    assert waited < 5
