"""The shared HTTP helpers against a small aiohttp server that misbehaves on purpose.

The server runs on its own event loop in a thread, so that both the async
helpers and the synchronous entry point (``run_sync``) can talk to it.
"""

import asyncio
import contextlib
import datetime
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from megatron_grpo import http

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeServer:
    url: str
    calls: list = field(default_factory=list)
    """One ``(content_type, decoded JSON body or None)`` per request."""


@contextlib.contextmanager
def fake_server(answer):
    """Answer every request with ``await answer(call_number)``; a thread serves it."""
    loop = asyncio.new_event_loop()
    server = FakeServer(url="")

    async def handle(request):
        body = await request.json() if request.can_read_body else None
        server.calls.append((request.content_type, body))
        return await answer(len(server.calls))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}/score"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _refused_url() -> str:
    with socket.socket() as sock:  # a port nobody listens on once this closes
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/score"


def _post_checked(url, attempts_seen=None, timeout_s=5.0):
    """An attempt for ``http.retrying``: POST, then fail on a status of 400 or more."""

    async def attempt(k):
        if attempts_seen is not None:
            attempts_seen.append(k)
        reply = await http.request("POST", url, {"k": k}, timeout_s=timeout_s)
        reply.raise_for_status()
        return reply

    return attempt


# --------------------------------------------------------------------------- the policy


def test_backoff_doubles_up_to_the_cap():
    delays = [http.backoff_delay_s(k, initial_s=0.5, max_s=3.0) for k in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_backoff_without_a_cap_keeps_doubling():
    delays = [http.backoff_delay_s(k, initial_s=0.25, max_s=math.inf) for k in range(5)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0]


def test_what_is_retried():
    url = "http://host/x"
    assert http.is_retryable(http.ConnectionFailed(url, "refused"))
    assert http.is_retryable(http.RequestTimedOut(url, "timed out after 1 s"))
    assert http.is_retryable(http.HTTPStatusError(url, 503, "busy"))
    assert not http.is_retryable(http.HTTPStatusError(url, 400, "bad field"))
    assert not http.is_retryable(http.HTTPStatusError(url, 404, ""))


# --------------------------------------------------------------------------- against a server


def test_503_twice_then_200_is_three_attempts_with_the_backoff_between():
    async def answer(call):
        if call <= 2:
            return web.json_response({"error": "busy"}, status=503)
        return web.json_response({"score": 1.5})

    policy = http.RetryPolicy(max_retries=3, initial_s=0.1, max_s=0.15)
    seen: list[int] = []
    with fake_server(answer) as server:
        start = time.monotonic()
        reply = http.run_sync(http.retrying(_post_checked(server.url, seen), policy))
        elapsed = time.monotonic() - start
    assert reply.status == 200 and reply.json() == {"score": 1.5}
    assert seen == [0, 1, 2] and len(server.calls) == 3
    assert elapsed >= 0.1 + 0.15  # backoff before retry 0, then before retry 1 (capped)


def test_400_is_not_retried_and_the_error_names_url_status_and_body():
    async def answer(call):
        return web.json_response({"error": "unknown field `foo`"}, status=400)

    policy = http.RetryPolicy(max_retries=3, initial_s=0.01)
    with fake_server(answer) as server:
        with pytest.raises(http.HTTPStatusError) as caught:
            http.run_sync(http.retrying(_post_checked(server.url), policy))
    assert len(server.calls) == 1
    assert caught.value.status == 400
    assert (
        str(caught.value) == f'{server.url} answered HTTP 400: {{"error": "unknown field `foo`"}}'
    )


def test_5xx_until_the_retries_are_spent_names_the_attempts_and_the_last_error():
    async def answer(call):
        return web.Response(text=f"down {call}", status=500)

    policy = http.RetryPolicy(max_retries=2, initial_s=0.01)
    with fake_server(answer) as server:
        with pytest.raises(http.RetriesExhausted) as caught:
            http.run_sync(http.retrying(_post_checked(server.url), policy))
    assert len(server.calls) == 3
    assert caught.value.attempts == 3
    assert isinstance(caught.value.last, http.HTTPStatusError) and caught.value.last.status == 500
    assert (
        str(caught.value) == f"{server.url} failed after 3 attempts; last error: HTTP 500: down 3"
    )


def test_a_long_body_is_quoted_only_in_part():
    error = http.HTTPStatusError("http://host/x", 502, "x" * 1000)
    shown = str(error)
    assert "x" * http.PREVIEW_CHARS in shown and "x" * (http.PREVIEW_CHARS + 1) not in shown
    assert error.body == "x" * 1000
    assert str(http.HTTPStatusError("http://host/x", 502, "")).endswith("<empty body>")


def test_a_refused_port_fails_with_a_message_naming_the_url():
    url = _refused_url()
    with pytest.raises(http.ConnectionFailed) as caught:
        http.run_sync(http.request("GET", url, timeout_s=5.0))
    assert str(caught.value).startswith(f"{url}: ")

    seen: list[int] = []
    policy = http.RetryPolicy(max_retries=1, initial_s=0.01)
    with pytest.raises(http.RetriesExhausted) as exhausted:
        http.run_sync(http.retrying(_post_checked(url, seen), policy))
    assert seen == [0, 1]
    assert str(exhausted.value).startswith(f"{url} failed after 2 attempts; last error: ")


def test_a_slow_answer_times_out_and_is_retried():
    async def answer(call):
        await asyncio.sleep(10)
        return web.json_response({})

    policy = http.RetryPolicy(max_retries=1, initial_s=0.01)
    with fake_server(answer) as server:
        start = time.monotonic()
        with pytest.raises(http.RetriesExhausted) as caught:
            http.run_sync(http.retrying(_post_checked(server.url, timeout_s=0.2), policy))
        elapsed = time.monotonic() - start
    assert len(server.calls) == 2 and elapsed < 5
    assert isinstance(caught.value.last, http.RequestTimedOut)
    assert "last error: timed out after 0.2 s" in str(caught.value)


def test_an_error_that_is_not_an_http_failure_ends_the_loop_at_once():
    seen: list[int] = []

    async def attempt(k):
        seen.append(k)
        raise KeyError("a bug in the caller")

    with pytest.raises(KeyError):
        http.run_sync(http.retrying(attempt, http.RetryPolicy(max_retries=3, initial_s=0.01)))
    assert seen == [0]


def test_the_body_goes_as_json_and_the_answer_comes_back_whatever_its_status():
    async def answer(call):
        return web.Response(text="not json", status=404)

    body = {"response": "abc", "metadata": {"day": datetime.date(2024, 5, 1)}}
    with fake_server(answer) as server:
        reply = http.run_sync(
            http.request("POST", server.url, body, timeout_s=5.0, json_default=str)
        )
    assert server.calls == [
        ("application/json", {"response": "abc", "metadata": {"day": "2024-05-01"}})
    ]
    assert reply.status == 404 and reply.text == "not json"
    with pytest.raises(ValueError, match=f"{server.url} answered non-JSON: 'not json'"):
        reply.json()
    with pytest.raises(http.HTTPStatusError, match="answered HTTP 404: not json"):
        reply.raise_for_status()


def test_a_given_session_is_used_and_left_open():
    async def answer(call):
        return web.json_response({"call": call})

    async def two_calls(url):
        async with aiohttp.ClientSession() as session:
            first = await http.request("GET", url, timeout_s=5.0, session=session)
            second = await http.request("GET", url, timeout_s=5.0, session=session)
            return first.json(), second.json(), session.closed

    with fake_server(answer) as server:
        first, second, closed = asyncio.run(two_calls(server.url))
    assert (first, second, closed) == ({"call": 1}, {"call": 2}, False)
    assert [body for _, body in server.calls] == [None, None]


def test_run_sync_refuses_to_run_inside_an_event_loop():
    async def inside():
        with pytest.raises(RuntimeError, match="inside a running event loop"):
            http.run_sync(asyncio.sleep(0))

    asyncio.run(inside())
