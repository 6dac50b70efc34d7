"""The connection to a set of SGLang servers (or embedded ones) and the calls that are
not generation: health, cache, pause, memory release and resume, weight updates, info.

A call goes to one server or, fanned out, to every server in use at once; it is not
retried, and it waits at most ``control_timeout_s`` (``weight_update_timeout_s`` for
weight updates). ``SGLangClient`` (``client.py``) adds generation on top.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, Literal, Self

import aiohttp

from megatron_grpo import http
from megatron_grpo.rollout.client_config import ClientConfig
from megatron_grpo.sglang_api.errors import (
    RolloutHTTPError,
    RolloutProtocolError,
    RolloutTimeoutError,
    ServerUnavailableError,
)
from megatron_grpo.sglang_api.memory import RELEASE_PATH, RESUME_PATH, memory_body

PauseMode = Literal["abort", "retract", "in_place"]


class EngineCalls:
    """Control and weight-update calls to the servers of ``config``; use as
    ``async with``, which opens and closes the HTTP session."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.all_urls = tuple(url.rstrip("/") for url in config.urls)
        self._urls = self.all_urls
        self._next_url = itertools.cycle(range(len(self._urls)))  # round-robin over _urls
        self._session: aiohttp.ClientSession | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers in use: all of ``config.urls`` unless ``use_only`` left some out."""
        return self._urls

    def use_only(self, urls: Sequence[str]) -> None:
        """Generate on, and send control and weight calls to, only ``urls`` (some of
        ``config.urls``, in their order) from now on."""
        wanted = set(urls)
        if not wanted or not wanted <= set(self.all_urls):
            raise ValueError(f"use_only needs some of {self.all_urls}, got {list(urls)}")
        self._urls = tuple(u for u in self.all_urls if u in wanted)
        self._next_url = itertools.cycle(range(len(self._urls)))

    async def __aenter__(self) -> Self:
        # No connection limit here: SGLangClient's semaphore bounds /generate, and an abort
        # or pause must never queue behind the generations it is meant to stop.
        # SGLang (uvicorn) drops idle connections after 5 s; never reuse one idle that long.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
        # The API key, if any, goes with every request of the session (generation too).
        self._session = aiohttp.ClientSession(connector=connector, headers=self.config.headers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- control ----

    async def health_generate(self) -> dict[str, bool]:
        """Per server: did ``/health_generate`` (a one-token generation) answer 200?"""
        results = await asyncio.gather(
            *(self._call("GET", url, "/health_generate") for url in self._urls),
            return_exceptions=True,
        )
        return {url: not isinstance(r, BaseException) for url, r in zip(self._urls, results)}

    async def flush_cache(self) -> None:
        await self._fan_out("POST", "/flush_cache", None)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating on every server; ``abort`` (SGLang's default) ends running requests."""
        await self._fan_out("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._fan_out("POST", "/continue_generation", {})

    # ---- memory (colocated placement) ----

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Every server frees the memory of ``tags`` (None: all; ``sglang_api.memory``) and
        answers once it is freed. No request may be running: pause generation first."""
        body = memory_body(tags)
        await self._fan_out("POST", RELEASE_PATH, body)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Every server takes back the memory of ``tags`` (None: all); resumed weights hold
        nothing meaningful until the next weight update."""
        body = memory_body(tags)
        await self._fan_out("POST", RESUME_PATH, body)

    # ---- weights ----

    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang 0.5.23 refuses tensor updates outside one)."""
        await self._fan_out("POST", "/begin_weight_update", {}, weight_update=True)

    async def end_weight_update(self) -> None:
        await self._fan_out("POST", "/end_weight_update", {}, weight_update=True)

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str, load_format: str | None = None
    ) -> None:
        """Every server loads the HF checkpoint at ``model_path`` and reports ``weight_version``."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": weight_version}
        if load_format is not None:
            body["load_format"] = load_format
        await self._fan_out("POST", "/update_weights_from_disk", body, weight_update=True)

    async def update_weights_from_tensor(self, payload: Any, *, url: str) -> None:
        """Send an already built ``/update_weights_from_tensor`` request to one server: a
        JSON body (SGLang's) or the embedded server's ``TensorUpdate``."""
        from urllib.parse import urlencode

        from megatron_grpo.embedded.weights import TensorUpdate

        if isinstance(payload, TensorUpdate):
            path = f"/update_weights_from_tensor?{urlencode(payload.query)}"
            await self._call("POST", url, path, payload.body, weight_update=True)
            return
        await self._call(
            "POST", url, "/update_weights_from_tensor", dict(payload), weight_update=True
        )

    async def update_weights_from_delta(self, body: bytes, *, url: str) -> list[str]:
        """Send a delta bucket (``embedded.delta``) to one embedded server; the names it
        could not apply, to push in full (``/update_weights_from_delta``, its own endpoint)."""
        path = "/update_weights_from_delta"
        answer = await self._call("POST", url, path, body, weight_update=True)
        return list(answer["failed"])

    async def init_weights_update_group(
        self,
        *,
        url: str,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Ask one server to join the trainer's process group (the trainer is rank 0).

        The server blocks until the trainer joins too, so start this call as a
        task and join the group before awaiting it.
        """
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._call("POST", url, "/init_weights_update_group", body, weight_update=True)

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str,
    ) -> None:
        """Announce tensors that the trainer then broadcasts; start as a task, then broadcast."""
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "weight_version": weight_version,
        }
        await self._fan_out("POST", "/update_weights_from_distributed", body, weight_update=True)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        body = {"group_name": group_name}
        await self._fan_out("POST", "/destroy_weights_update_group", body, weight_update=True)

    async def get_weights_by_name(self, name: str, *, truncate_size: int, url: str) -> Any:
        """One server's weight ``name`` as nested lists, cut to ``truncate_size`` rows."""
        body = {"name": name, "truncate_size": truncate_size}
        return await self._call("POST", url, "/get_weights_by_name", body, weight_update=True)

    async def weights_checksum(
        self, names: Sequence[str], dtypes: Sequence[str], *, url: str
    ) -> list[str]:
        """One embedded server's checksums of the weights ``names``, each in its dtype of
        ``dtypes`` (``/weights_checksum``, the embedded server's own endpoint)."""
        body = {"names": list(names), "dtypes": list(dtypes)}
        answer = await self._call("POST", url, "/weights_checksum", body, weight_update=True)
        return list(answer["checksums"])

    # ---- info ----

    async def model_info(self, url: str | None = None) -> dict[str, Any]:
        return await self._call("GET", url or self._urls[0], "/model_info")

    async def server_info(self, url: str | None = None) -> dict[str, Any]:
        return await self._call("GET", url or self._urls[0], "/server_info")

    # ---- plumbing ----

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            name = type(self).__name__
            raise RuntimeError(f"{name} is not open: use `async with {name}(...)`")
        return self._session

    async def _fan_out(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        urls: Sequence[str] | None = None,
        weight_update: bool = False,
    ) -> dict[str, Any]:
        """Call every server concurrently; raise the first failure once all have answered."""
        targets = tuple(urls or self._urls)
        results = await asyncio.gather(
            *(self._call(method, u, path, body, weight_update=weight_update) for u in targets),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(targets, results))

    async def _call(
        self,
        method: str,
        url: str,
        path: str,
        body: dict[str, Any] | bytes | None = None,
        *,
        weight_update: bool = False,
    ) -> Any:
        """One control request, not retried: JSON answer (or text), or a RolloutError."""
        limit = (
            self.config.weight_update_timeout_s if weight_update else self.config.control_timeout_s
        )
        try:
            reply = await http.request(
                method,
                f"{url}{path}",
                body,
                timeout_s=limit,
                connect_timeout_s=self.config.connect_timeout_s,
                session=self._require_session(),
            )
        except http.RequestTimedOut as err:
            raise RolloutTimeoutError(f"{url}{path} took longer than {limit} s") from err
        except http.RequestError as err:
            raise ServerUnavailableError(str(err)) from err
        if reply.status >= 400:
            raise RolloutHTTPError(url=reply.url, status=reply.status, body=reply.text)
        is_json = reply.content_type == "application/json"
        answer = decode_json(reply) if is_json and reply.text else reply.text
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RolloutHTTPError(url=reply.url, status=reply.status, body=reply.text)
        return answer


def decode_json(reply: http.Reply) -> Any:
    """The JSON body of ``reply``; a body that is not JSON raises RolloutProtocolError."""
    try:
        return reply.json()
    except ValueError as err:
        raise RolloutProtocolError(str(err)) from err
