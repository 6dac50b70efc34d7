"""HTTP requests as the package makes them: JSON over aiohttp, with one retry policy.

``request`` makes one attempt and returns the answer whatever its status, or
raises ``ConnectionFailed`` / ``RequestTimedOut`` when no whole answer came.
``retrying`` repeats an attempt with exponential backoff on connection
errors, timeouts and HTTP 5xx, never on HTTP 4xx (the request itself is
wrong). Asynchronous callers pass their own ``aiohttp.ClientSession``;
synchronous ones (server start-up and shut-down, the remote reward) wrap the
call in ``run_sync``, which runs it on a short-lived event loop of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREVIEW_CHARS = 200
"""How much of an answer's body an error message quotes."""


def preview(text: str) -> str:
    """The start of a body for an error message."""
    return text.strip()[:PREVIEW_CHARS] or "<empty body>"


class RequestError(Exception):
    """A request that got no usable answer; ``reason`` says why, the message names the URL."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.url}: {self.reason}"


class ConnectionFailed(RequestError):
    """Refused, reset, connect timed out, or cut off mid-answer: the server may be down."""


class RequestTimedOut(RequestError):
    """The whole answer did not come within the request's time limit."""


class HTTPStatusError(RequestError):
    """The server answered with status 400 or above."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(url, f"HTTP {status}: {preview(body)}")
        self.status = status
        self.body = body

    def __str__(self) -> str:
        return f"{self.url} answered {self.reason}"


class RetriesExhausted(RequestError):
    """Every attempt failed in a way worth retrying; ``last`` is the final failure."""

    def __init__(self, last: RequestError, attempts: int) -> None:
        super().__init__(last.url, f"failed after {attempts} attempts; last error: {last.reason}")
        self.last = last
        self.attempts = attempts

    def __str__(self) -> str:
        return f"{self.url} {self.reason}"


@dataclass(frozen=True)
class Reply:
    """A server's answer: its status and its body as text."""

    url: str
    status: int
    text: str
    content_type: str

    def json(self) -> Any:
        """The body decoded as JSON; ValueError naming the URL when it is not JSON."""
        try:
            return json.loads(self.text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{self.url} answered non-JSON: {self.text[:PREVIEW_CHARS]!r}"
            ) from err

    def raise_for_status(self) -> None:
        """HTTPStatusError when the status is 400 or above."""
        if self.status >= 400:
            raise HTTPStatusError(self.url, self.status, self.text)


async def request(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    session: aiohttp.ClientSession | None = None,
    json_default: Callable[[Any], Any] | None = None,
) -> Reply:
    """One attempt at ``method url`` with ``body`` sent as JSON (``bytes`` as they are, an
    ``application/octet-stream``): the answer, whatever its status.

    ``timeout_s`` bounds the whole exchange, ``connect_timeout_s`` opening the
    connection. ``json_default`` encodes values JSON has no type for. Without
    a ``session`` the request opens (and closes) one of its own.
    """
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await request(
                method,
                url,
                body,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
                session=own,
                json_default=json_default,
            )
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
    data: bytes | None = None
    headers = None
    if isinstance(body, bytes):
        data, headers = body, {"Content-Type": "application/octet-stream"}
    elif body is not None:
        data = json.dumps(body, default=json_default).encode()
        headers = {"Content-Type": "application/json"}
    try:
        async with session.request(
            method, url, data=data, headers=headers, timeout=timeout
        ) as response:
            text = await response.text(errors="replace")
            return Reply(url, response.status, text, response.content_type)
    except aiohttp.ConnectionTimeoutError as err:  # also a TimeoutError: test it first
        raise ConnectionFailed(url, f"connect timed out ({err})") from err
    except asyncio.TimeoutError as err:  # builtin TimeoutError only from Python 3.11
        raise RequestTimedOut(url, f"timed out after {timeout_s:g} s") from err
    except aiohttp.ClientError as err:
        raise ConnectionFailed(url, f"{type(err).__name__}: {err}") from err


# --------------------------------------------------------------------------- retries


def backoff_delay_s(retry: int, *, initial_s: float, max_s: float) -> float:
    """Wait before retry number ``retry`` (0-based): initial, 2x, 4x, ... capped at max."""
    return min(max_s, initial_s * 2.0**retry)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often to retry a request that may succeed later, and how long to wait between."""

    max_retries: int
    """Retries after the first attempt."""
    initial_s: float
    """Wait before the first retry; it doubles on each further retry."""
    max_s: float = math.inf
    """Longest wait between retries."""

    @property
    def attempts(self) -> int:
        return self.max_retries + 1


def is_retryable(error: RequestError) -> bool:
    """Connection errors, timeouts and HTTP 5xx may pass on a later attempt; HTTP 4xx will not."""
    if isinstance(error, HTTPStatusError):
        return error.status >= 500
    return isinstance(error, ConnectionFailed | RequestTimedOut)


async def retrying(attempt: Callable[[int], Awaitable[T]], policy: RetryPolicy) -> T:
    """``await attempt(k)`` for k = 0, 1, ... until it returns; its result.

    A retryable ``RequestError`` (see ``is_retryable``) is tried again after
    ``backoff_delay_s``; once ``policy.attempts`` attempts have failed so,
    raises ``RetriesExhausted``. Any other exception ends the loop at once.
    """
    last: RequestError | None = None
    for k in range(policy.attempts):
        if k > 0:
            await asyncio.sleep(
                backoff_delay_s(k - 1, initial_s=policy.initial_s, max_s=policy.max_s)
            )
        try:
            return await attempt(k)
        except RequestError as err:
            if not is_retryable(err):
                raise
            last = err
            logger.warning("attempt %d/%d failed: %s", k + 1, policy.attempts, err)
    assert last is not None
    raise RetriesExhausted(last, policy.attempts)


# --------------------------------------------------------------------------- sync callers


def run_sync(call: Coroutine[Any, Any, T]) -> T:
    """Run ``call`` to its end on an event loop of its own; for callers without a loop.

    The loop lives for this call only and is not made the thread's current
    loop. From inside a running loop, await the call instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        call.close()
        raise RuntimeError("run_sync() called inside a running event loop: await the call")
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(call)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
