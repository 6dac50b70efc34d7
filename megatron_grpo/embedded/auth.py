"""Who may call the embedded server: SGLang's ``--api-key`` convention.

With a key, every request but the liveness probes (``/health``, ``/health_generate``,
which read and change nothing, as SGLang exempts them) must carry
``Authorization: Bearer <key>``; any other gets HTTP 401 with a JSON error. The header is
compared in constant time. A server that listens beyond loopback must have a key: the
weight and control endpoints would otherwise be open to anyone who reaches the port.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from megatron_grpo.config.rollout import is_loopback

UNAUTHENTICATED_PATHS = frozenset({"/health", "/health_generate"})
"""Answered without a key, as SGLang answers ``/health*``."""


def check_api_key(api_key: str | None, host: str) -> None:
    """ValueError when ``api_key`` cannot be sent in a header, or when a server on ``host``
    (beyond loopback) would have none."""
    if api_key is not None:
        if not api_key or not api_key.isprintable() or not api_key.isascii():
            raise ValueError("the API key must be a non-empty string of printable ASCII")
        return
    if not is_loopback(host):
        raise ValueError(
            f"the embedded server would listen on {host!r}, beyond loopback, where anyone "
            "who reaches the port could replace its weights: give it an API key (--api-key "
            "or --api-key-env; for servers the trainer starts, rollout.engines.api_key_env names "
            "the environment variable holding it), or listen on 127.0.0.1"
        )


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant time)."""
    if header is None:
        return False
    # Bytes: compare_digest takes ASCII str only, and a header may hold anything.
    given = header.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


def api_key_middleware(api_key: str) -> Middleware:
    """An aiohttp middleware that answers 401 to requests without ``api_key``."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        # The route aiohttp matched, not the raw path: /health/../generate is /generate.
        resource = request.match_info.route.resource
        path = None if resource is None else resource.canonical
        # (No exemption for OPTIONS, unlike SGLang: some routes here answer any method.)
        if path in UNAUTHENTICATED_PATHS:
            return await handler(request)
        if not authorized(request.headers.get("Authorization"), api_key):
            return web.json_response(
                {"error": "Unauthorized: send the server's API key as Authorization: Bearer <key>"},
                status=401,
            )
        return await handler(request)

    return authenticate
