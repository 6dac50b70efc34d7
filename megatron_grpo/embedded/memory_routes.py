"""The embedded server's ``/release_memory_occupation`` and ``/resume_memory_occupation``.

As SGLang 0.5.23 serves them (``sglang_api.memory``): a body ``{"tags": [...]}`` (absent,
null or empty: every tag), an answer once the memory is freed or allocated again, HTTP 200
with the JSON body ``null``, a failure HTTP 400 ``{"error": {"message": ...}}``. What the
engine does per tag is in ``engine.py``. Where SGLang would take the server down, this one
answers 400 naming the state: a release while a request runs, a tag released twice, a
resume of a tag that is not released; an unknown tag, which SGLang ignores, is refused too.

While memory is released, ``refuse_while_released`` (a middleware) answers the requests
that need it with HTTP 400 naming the released tags (not a 5xx, which clients retry):
``/generate`` while any tag is released, the weight updates and reads (``WEIGHT_PATHS``)
while ``weights`` is.
``/health_generate`` answers 200 (a sleeping engine is alive), the rest as usual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from megatron_grpo.embedded.engine import GenerationEngine, MemoryStateError, released_message
from megatron_grpo.embedded.weight_routes import json_object
from megatron_grpo.sglang_api.memory import RELEASE_PATH, RESUME_PATH, WEIGHTS, memory_tags

GENERATE_PATHS = frozenset({"/generate"})
WEIGHT_PATHS = frozenset(
    {
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_delta",
        "/get_weights_by_name",
        "/weights_checksum",
    }
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


class MemoryRoutes:
    """The two endpoints and the middleware, over one engine."""

    def __init__(self, engine: GenerationEngine, *, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, RELEASE_PATH, self.release)
            app.router.add_route(method, RESUME_PATH, self.resume)

    async def release(self, request: web.Request) -> web.Response:
        return await self._act(request, self._release)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._act(request, self.engine.resume_memory)

    def _release(self, tags: tuple[str, ...]) -> None:
        self.engine.release_memory(tags, timeout_s=self.timeout_s)

    async def _act(
        self, request: web.Request, act: Callable[[tuple[str, ...]], None]
    ) -> web.Response:
        try:
            tags = memory_tags((await json_object(request)).get("tags") or None)
        except ValueError as err:
            return _error(f"{request.path}: {err}")
        try:
            await asyncio.get_running_loop().run_in_executor(None, act, tags)
        except (MemoryStateError, TimeoutError) as err:
            return _error(str(err))
        return web.json_response(None)

    @web.middleware
    async def refuse_while_released(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        released = self.engine.released_tags
        if released and request.path in GENERATE_PATHS:
            return _error(released_message(request.path, released))
        if WEIGHTS in released and request.path in WEIGHT_PATHS:
            return _error(released_message(request.path, (WEIGHTS,)))
        return await handler(request)
