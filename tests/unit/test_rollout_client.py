"""The rollout client against small aiohttp servers that misbehave on purpose.

Each failure must end in a retry or a clear error within its timeout (never a
hang), and the samples that did finish must come back on the error.
"""

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.sglang_api.errors import (
    RolloutBatchError,
    RolloutHTTPError,
    RolloutTimeoutError,
    ServerUnavailableError,
)
from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams
from megatron_grpo.testing import sglang_contract as contract

pytestmark = pytest.mark.timeout(60)

REQUEST = RolloutRequest(
    prompts=((1, 2, 3), (4, 5)), num_samples=2, sampling=SamplingParams(max_new_tokens=2, seed=7)
)


def _answer(input_ids: list, rid: str) -> dict:
    """A valid answer: two tokens derived from the prompt, so answers can be told apart."""
    first = input_ids[0]
    return {
        "text": "",
        "output_ids": [first, first + 1],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "w1",
            "output_token_logprobs": [[-0.25, first, None], [-0.5, first + 1, None]],
        },
    }


def _ok(body: dict) -> web.Response:
    """A valid answer to a request for one sample or (SGLang's batch form) several."""
    if isinstance(body["input_ids"][0], list):
        answers = [_answer(ids, rid) for ids, rid in zip(body["input_ids"], body["rid"])]
        return web.json_response(answers)
    return web.json_response(_answer(body["input_ids"], body["rid"]))


def rids(bodies: list) -> list:
    """Every sample's rid in the requests, in order."""
    return [r for b in bodies for r in b["rid"]]


@dataclass
class FaultServer:
    url: str
    bodies: list = field(default_factory=list)
    aborts: list = field(default_factory=list)


@contextlib.asynccontextmanager
async def fault_server(respond):
    """Serve /generate with ``await respond(body, call_number)`` and record /abort_request."""
    server = FaultServer(url="")

    async def generate(request):
        body = await request.json()
        server.bodies.append(body)
        return await respond(body, len(server.bodies))

    async def abort(request):
        server.aborts.append(await request.json())
        return web.Response()

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


def _config(*urls, **overrides):
    settings = dict(urls=urls, max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.05)
    settings.update(overrides)
    return ClientConfig(**settings)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="urls is empty"):
        ClientConfig(urls=())
    with pytest.raises(ValueError, match="http://"):
        ClientConfig(urls=("localhost:3000",))
    with pytest.raises(ValueError, match="request_timeout_s"):
        ClientConfig(urls=("http://x",), request_timeout_s=0)


def test_requests_satisfy_contract_and_samples_come_back_in_order():
    async def scenario():
        async def respond(body, call):
            return _ok(body)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                samples = await client.generate(REQUEST)
        return server, samples

    server, samples = asyncio.run(scenario())
    assert len(server.bodies) == 2  # one request per prompt group
    for body in server.bodies:
        contract.validate_request(body)
    assert len(set(rids(server.bodies))) == 4
    seeds = [p["sampling_seed"] for b in server.bodies for p in b["sampling_params"]]
    assert sorted(seeds) == [7, 8, 9, 10]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert samples[2].prompt_ids == (4, 5) and samples[2].output_ids == (4, 5)
    assert samples[2].rollout_logprobs == (-0.25, -0.5) and samples[2].weight_version == "w1"


def test_through_a_router_each_sample_is_a_request_of_its_own():
    """sglang-router's /generate takes one rid string: no batch form through it."""

    async def scenario():
        async def respond(body, call):
            return _ok(body)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url, group_requests=False)) as client:
                samples = await client.generate(REQUEST)
        return server, samples

    server, samples = asyncio.run(scenario())
    assert len(server.bodies) == 4 and all(isinstance(b["rid"], str) for b in server.bodies)
    for body in server.bodies:
        contract.validate_request(body)
    assert sorted(b["sampling_params"]["sampling_seed"] for b in server.bodies) == [7, 8, 9, 10]
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_http_500_is_retried():
    async def scenario():
        async def respond(body, call):
            if call <= 2:
                return web.json_response({"error": "overloaded"}, status=500)
            return _ok(body)

        one = RolloutRequest(prompts=((1,),))
        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                return server, await client.generate(one)

    server, samples = asyncio.run(scenario())
    assert len(server.bodies) == 3 and len(samples) == 1
    assert len(set(rids(server.bodies))) == 3  # a fresh rid per attempt


def test_http_500_gives_up_after_the_retries():
    async def scenario():
        async def respond(body, call):
            return web.json_response({"error": "still broken"}, status=500)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                with pytest.raises(RolloutBatchError) as caught:
                    await client.generate(RolloutRequest(prompts=((1,),)))
        return server, caught.value

    server, error = asyncio.run(scenario())
    assert len(server.bodies) == 3
    [failure] = error.failures
    assert isinstance(failure.error, RolloutHTTPError) and failure.error.status == 500
    assert "after 3 attempts" in str(failure.error) and "still broken" in str(failure.error)


def test_http_400_is_not_retried_and_shows_the_server_message():
    async def scenario():
        async def respond(body, call):
            return web.json_response({"error": "unknown field `foo`"}, status=400)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                with pytest.raises(RolloutBatchError) as caught:
                    await client.generate(RolloutRequest(prompts=((1,),)))
        return server, caught.value

    server, error = asyncio.run(scenario())
    assert len(server.bodies) == 1
    assert isinstance(error.failures[0].error, RolloutHTTPError)
    assert error.failures[0].error.status == 400
    assert "unknown field `foo`" in str(error)


def test_connection_refused_is_retried_then_a_clear_error():
    async def scenario():
        url = f"http://127.0.0.1:{_free_port()}"
        async with SGLangClient(_config(url)) as client:
            with pytest.raises(RolloutBatchError) as caught:
                await client.generate(RolloutRequest(prompts=((1,),)))
        return caught.value

    start = time.monotonic()
    error = asyncio.run(scenario())
    assert time.monotonic() - start < 10
    [failure] = error.failures
    assert isinstance(failure.error, ServerUnavailableError)
    assert "gave up after 3 attempts" in str(failure.error)
    assert error.completed == []


def test_timeout_is_not_retried_and_aborts_the_request():
    async def scenario():
        async def respond(body, call):
            await asyncio.sleep(30)
            return _ok(body)

        async with fault_server(respond) as server:
            config = _config(server.url, request_timeout_s=0.3)
            async with SGLangClient(config) as client:
                with pytest.raises(RolloutBatchError) as caught:
                    await client.generate(RolloutRequest(prompts=((1,),)))
            # the client's close() waited for its abort call
            return server, caught.value

    start = time.monotonic()
    server, error = asyncio.run(scenario())
    assert time.monotonic() - start < 10
    assert len(server.bodies) == 1
    assert isinstance(error.failures[0].error, RolloutTimeoutError)
    assert "request_timeout_s=0.3" in str(error)
    assert server.aborts == [{"rid": server.bodies[0]["rid"][0]}]


def test_partial_failure_keeps_the_completed_samples():
    async def scenario():
        async def respond(body, call):
            if body["input_ids"][0][0] == 4:  # prompt 1 is refused
                return web.json_response({"error": "prompt too long"}, status=400)
            return _ok(body)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                with pytest.raises(RolloutBatchError) as caught:
                    await client.generate(REQUEST)
        return caught.value

    error = asyncio.run(scenario())
    assert [(s.prompt_index, s.sample_index) for s in error.completed] == [(0, 0), (0, 1)]
    assert [(f.prompt_index, f.sample_index) for f in error.failures] == [(1, 0), (1, 1)]
    assert "prompt too long" in str(error)


def test_round_robin_retries_on_the_next_server():
    async def scenario():
        async def broken(body, call):
            return web.json_response({"error": "down"}, status=503)

        async def healthy(body, call):
            return _ok(body)

        async with fault_server(broken) as bad, fault_server(healthy) as good:
            async with SGLangClient(_config(bad.url, good.url, max_retries=1)) as client:
                samples = await client.generate(REQUEST)
        return bad, good, samples

    bad, good, samples = asyncio.run(scenario())
    assert len(samples) == 4
    # round-robin: one of the two groups' first attempts hits the broken server, and
    # its retry lands on the healthy one
    assert len(bad.bodies) == 1 and len(good.bodies) == 2


def test_cancelling_generate_aborts_in_flight_requests():
    async def scenario():
        received = asyncio.Event()

        async def respond(body, call):
            received.set()
            await asyncio.sleep(30)
            return _ok(body)

        async with fault_server(respond) as server:
            async with SGLangClient(_config(server.url)) as client:
                task = asyncio.create_task(client.generate(RolloutRequest(prompts=((1,),))))
                await asyncio.wait_for(received.wait(), 10)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return server

    server = asyncio.run(scenario())
    assert server.aborts == [{"rid": server.bodies[0]["rid"][0]}]
