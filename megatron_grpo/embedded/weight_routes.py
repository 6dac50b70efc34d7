"""The embedded server's broadcast weight updates and weight reads, as SGLang serves them.

- ``/init_weights_update_group`` joins a weight-broadcast group (gloo) as
  ``rank_offset``; the trainer's sender is rank 0. Several groups may be open at once,
  one per pipeline stage of the trainer, each under its own ``group_name``.
- ``/update_weights_from_distributed`` receives the announced tensors from that group's
  rank 0 and loads them; it answers once they are loaded.
- ``/destroy_weights_update_group`` leaves a group.
- ``/get_weights_by_name`` returns a weight as SGLang does: ``tensor.float().tolist()``
  cut to its first ``truncate_size`` entries (rows of a matrix).

Ours, not SGLang's (an SGLang server answers 404):
- ``/weights_checksum`` (POST ``{"names": [...], "dtypes": [...]}``) answers
  ``{"algorithm": "xxh3_64", "checksums": [...]}``: for each named weight, the checksum of
  its bytes in the dtype given (``embedded.checksum``), that of the tensor a sender pushed
  in that dtype; the engine holds fp32, which keeps a bf16 or fp16 push exactly. An unknown
  name or dtype answers 400 naming it.
- ``/update_weights_from_delta`` (``rollout.sync.delta``; a body of ``embedded.delta``)
  XORs each tensor's delta into the engine's bytes of it in the dtype sent, loads those
  whose checksum is the sender's, and answers ``{"success": true, "failed": [names]}``: the
  names to push in full (every name, the unchanged ones too, when the engine's version is
  neither the delta's base nor the version being pushed). Loaded or not, the engine then
  reports the pushed ``weight_version``, as after ``/update_weights_from_tensor``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from megatron_grpo.embedded.checksum import ALGORITHM, tensor_checksum
from megatron_grpo.embedded.delta import DELTA_CONTENT_TYPE, apply_delta, parse_body
from megatron_grpo.embedded.engine import GenerationEngine
from megatron_grpo.embedded.weights import copy_into_model, hf_weights
from megatron_grpo.sglang_api.update_group import UpdateGroup, open_update_group


def outcome(success: bool, message: str) -> web.Response:
    return web.json_response(
        {"success": success, "message": message}, status=200 if success else 400
    )


async def json_object(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as err:
        raise web.HTTPBadRequest(text=f"body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    return body


def _missing(body: dict[str, Any], *keys: str) -> str | None:
    absent = [k for k in keys if k not in body]
    return f"missing field(s): {', '.join(absent)}" if absent else None


class WeightRoutes:
    """Handlers that share the open update groups; ``update(apply, version)`` loads."""

    def __init__(
        self,
        engine: GenerationEngine,
        update: Callable[[Any, Any], None],
        *,
        timeout_s: float,
    ) -> None:
        self.engine = engine
        self.update = update
        self.timeout_s = timeout_s
        self.groups: dict[str, UpdateGroup] = {}

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_group)
        app.router.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        app.router.add_post("/weights_checksum", self.weights_checksum)
        app.router.add_post("/update_weights_from_delta", self.update_from_delta)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
        if problem := _missing(body, *keys):
            return outcome(False, problem)
        backend = body.get("backend") or "gloo"
        if backend != "gloo":
            return outcome(False, f"the embedded server joins gloo groups only, not {backend!r}")
        name = str(body["group_name"])
        if name in self.groups:
            return outcome(False, f"weight update group {name!r} is already open")
        join = functools.partial(
            open_update_group,
            master_address=str(body["master_address"]),
            master_port=int(body["master_port"]),
            world_size=int(body["world_size"]),
            group_name=name,
            backend=backend,
            timeout_s=self.timeout_s,
            rank=int(body["rank_offset"]),
        )
        try:
            self.groups[name] = await asyncio.get_running_loop().run_in_executor(None, join)
        except (RuntimeError, ValueError) as err:  # torch raises DistStoreError etc.
            return outcome(False, f"Failed to join weight update group {name!r}: {err}")
        return outcome(True, "Succeeded to initialize custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        if problem := _missing(body, "names", "dtypes", "shapes", "group_name"):
            return outcome(False, problem)
        group = self.groups.get(str(body["group_name"]))
        if group is None:
            return outcome(False, f"no weight update group {body['group_name']!r} is open")
        loop = asyncio.get_running_loop()
        receive = functools.partial(group.receive, body["names"], body["dtypes"], body["shapes"])
        try:
            named = await loop.run_in_executor(None, receive)
            apply = functools.partial(copy_into_model, named_tensors=named, require_all=False)
            await loop.run_in_executor(None, self.update, apply, body.get("weight_version"))
        except (RuntimeError, ValueError, TimeoutError) as err:
            group.broken = True
            return outcome(False, f"Failed to update weights from the group: {err}")
        return outcome(True, "Succeeded to update parameter online.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = str((await json_object(request)).get("group_name", ""))
        group = self.groups.pop(name, None)
        if group is None:
            return outcome(False, f"no weight update group {name!r} is open")
        group.close()
        return outcome(True, "Succeeded to destroy custom process group.")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        if request.method == "GET" and not body:
            body = dict(request.query)
        name = str(body.get("name", ""))
        truncate = int(body.get("truncate_size", 100))
        weights = hf_weights(self.engine.model)
        if name not in weights:
            return web.json_response({"error": f"no weight named {name!r}"}, status=400)
        with torch.no_grad():
            values = weights[name].detach().float().tolist()[:truncate]
        return web.json_response(values)

    async def weights_checksum(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        names, dtypes = body.get("names"), body.get("dtypes")
        if not isinstance(names, list) or not isinstance(dtypes, list):
            return web.json_response({"error": "names and dtypes must be lists"}, status=400)
        if len(names) != len(dtypes):
            return web.json_response(
                {"error": f"{len(names)} names but {len(dtypes)} dtypes"}, status=400
            )
        weights = hf_weights(self.engine.model)
        wanted = []
        for name, dtype in zip(names, dtypes, strict=True):
            if name not in weights:
                return web.json_response({"error": f"no weight named {name!r}"}, status=400)
            as_dtype = getattr(torch, str(dtype), None)
            if not isinstance(as_dtype, torch.dtype):
                return web.json_response({"error": f"{name}: no dtype {dtype!r}"}, status=400)
            wanted.append((weights[name], as_dtype))

        def checksums() -> list[str]:
            with torch.no_grad():
                return [tensor_checksum(w.detach().to(d)) for w, d in wanted]

        values = await asyncio.get_running_loop().run_in_executor(None, checksums)
        return web.json_response({"algorithm": ALGORITHM, "checksums": values})

    async def update_from_delta(self, request: web.Request) -> web.Response:
        if request.content_type != DELTA_CONTENT_TYPE:
            return outcome(False, f"a delta update has Content-Type {DELTA_CONTENT_TYPE}")
        loop = asyncio.get_running_loop()
        try:
            header, frames = parse_body(await request.read())
        except ValueError as err:
            return outcome(False, str(err))
        version = str(header["weight_version"])
        if self.engine.weight_version not in (str(header["base_version"]), version):
            names = [t["name"] for t in header["tensors"]] + list(header["unchanged"])
            named: dict[str, torch.Tensor] = {}
            failed = names
        else:

            def decode() -> tuple[dict[str, torch.Tensor], list[str]]:
                with torch.no_grad():
                    weights = {k: v.detach() for k, v in hf_weights(self.engine.model).items()}
                    return apply_delta(weights, header, frames)

            named, failed = await loop.run_in_executor(None, decode)
        try:
            apply = functools.partial(copy_into_model, named_tensors=named, require_all=False)
            await loop.run_in_executor(None, self.update, apply, version)
        except (ValueError, TimeoutError) as err:
            return outcome(False, f"Failed to update weights from the delta: {err}")
        return web.json_response({"success": True, "message": "Success", "failed": failed})
