"""The embedded rollout server: SGLang's native HTTP API over a transformers model on CPU.

For machines without a GPU, where a real SGLang server is not the default:
the trainer's client talks to this server exactly as to SGLang (same
endpoints, same JSON, checked against SGLang's own contract in the tests).
The model is a Hugging Face causal LM in fp32; generation is real, batched
over everything queued (see ``engine.py``), and the logprobs are those of
the unmodified policy (see ``decode.py``).

Differences from SGLang worth knowing:
- no prefix cache (``/flush_cache`` succeeds and does nothing), no streaming,
  no prompt or top-k logprobs, no string stops or grammar constraints: such
  requests get HTTP 400 rather than a silently different answer;
- ``/update_weights_from_tensor`` takes a safetensors body (``weights.py``), and the
  distributed update joins gloo groups only (``weight_routes.py``);
- ``/health_generate`` answers 200 while paused instead of timing out;
- ``/release_memory_occupation`` frees the weights for real and refuses by name what SGLang
  would crash on, generation and weight updates into released memory among them
  (``memory_routes.py``);
- ``return_routed_experts`` needs no server flag (a model without MoE layers gets 400),
  and ``routed_experts_start_len`` is not implemented (400 unless 0).

With ``api_key`` (SGLang's ``--api-key``) every endpoint but ``/health`` and
``/health_generate`` wants ``Authorization: Bearer <key>`` (``auth.py``); a server that
listens beyond loopback refuses to start without one.

``start_embedded_server`` runs it on a background thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from megatron_grpo.embedded.auth import api_key_middleware, check_api_key
from megatron_grpo.embedded.engine import Finished, GenerationEngine
from megatron_grpo.embedded.memory_routes import MemoryRoutes
from megatron_grpo.embedded.protocol import (
    BadRequest,
    GenerateItem,
    generate_answer,
    parse_generate_body,
)
from megatron_grpo.embedded.routes import has_moe_layers
from megatron_grpo.embedded.weight_routes import WeightRoutes, json_object, outcome
from megatron_grpo.embedded.weights import (
    TENSOR_CONTENT_TYPE,
    copy_into_model,
    deserialize_named_tensors,
    hf_weights,
    load_hf_model,
    load_shared,
)
from megatron_grpo.sglang_api.types import SamplingParams

SERVER_VERSION = "megatron_grpo-embedded"
_HEALTH_TIMEOUT_S = 20.0


class _Server:
    """The routes and the little state they share besides the engine."""

    def __init__(
        self,
        engine: GenerationEngine,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        model_path: str,
        generate_timeout_s: float,
        weight_update_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.generate_timeout_s = generate_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.weight_session_open = False
        self.host = ""
        self.port = 0
        config = engine.model.config
        self.max_context = getattr(config, "max_position_embeddings", None)
        self.routes_experts = has_moe_layers(engine.model)

    def app(self, api_key: str | None = None) -> web.Application:
        """The routes; with ``api_key``, answered only to requests that carry it."""
        memory = MemoryRoutes(self.engine, timeout_s=self.weight_update_timeout_s)
        middlewares = [] if api_key is None else [api_key_middleware(api_key)]
        middlewares.append(memory.refuse_while_released)
        # client_max_size: tensor updates are large
        app = web.Application(client_max_size=1 << 31, middlewares=middlewares)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/begin_weight_update", self.begin_weight_update)
        app.router.add_post("/end_weight_update", self.end_weight_update)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        WeightRoutes(self.engine, self._update, timeout_s=self.weight_update_timeout_s).add_to(app)
        memory.add_to(app)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        return app

    # ---- generation ----

    async def generate(self, request: web.Request) -> web.Response:
        start = time.monotonic()
        try:
            body = await request.json()
            encode = None if self.tokenizer is None else self.tokenizer.encode
            parsed = parse_generate_body(body, encode=encode)
            for item in parsed.items:
                self._check_length(item)
                self._check_routes(item)
        except ValueError as err:  # BadRequest, and json.JSONDecodeError too
            return web.json_response({"error": str(err)}, status=400)
        try:
            futures = [
                self.engine.submit(
                    i.rid, i.prompt_ids, i.sampling, return_routed_experts=i.return_routed_experts
                )
                for i in parsed.items
            ]
        except RuntimeError as err:
            return web.json_response({"error": str(err)}, status=503)
        try:
            finished = await asyncio.wait_for(_all_finished(futures), self.generate_timeout_s)
        except asyncio.TimeoutError:  # builtin TimeoutError only from Python 3.11
            return web.json_response(
                {"error": f"generation took longer than {self.generate_timeout_s} s"}, status=504
            )
        except Exception as err:  # the model failed: a server error
            return web.json_response({"error": f"generation failed: {err!r}"}, status=500)
        latency = time.monotonic() - start
        answers = [
            self._answer(item, done, latency, parsed.return_text_in_logprobs)
            for item, done in zip(parsed.items, finished)
        ]
        return web.json_response(answers[0] if parsed.single else answers)

    def _check_length(self, item: GenerateItem) -> None:
        total = len(item.prompt_ids) + item.sampling.max_new_tokens
        if self.max_context is not None and total > self.max_context:
            raise BadRequest(
                f"prompt ({len(item.prompt_ids)} tokens) + max_new_tokens "
                f"({item.sampling.max_new_tokens}) exceeds the model's context of "
                f"{self.max_context} tokens"
            )
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in item.prompt_ids if t >= vocab]
        if bad:
            raise BadRequest(f"input_ids {bad[:5]} are outside the vocabulary of {vocab}")

    def _check_routes(self, item: GenerateItem) -> None:
        if item.return_routed_experts and not self.routes_experts:
            model = type(self.engine.model).__name__
            raise BadRequest(
                f"return_routed_experts=true, but the served model ({model}) has no "
                "mixture-of-experts layers whose routed experts could be returned"
            )

    def _answer(
        self, item: GenerateItem, done: Finished, latency_s: float, text_in_logprobs: bool
    ) -> dict[str, Any]:
        ids = done.completion.output_ids
        text, token_texts = "", None
        if self.tokenizer is not None:
            text = str(self.tokenizer.decode(ids, skip_special_tokens=item.skip_special_tokens))
            if text_in_logprobs:
                token_texts = [str(self.tokenizer.decode([t])) for t in ids]
        assert done.completion.finish_reason is not None
        return generate_answer(
            item,
            output_ids=ids,
            logprobs=done.completion.logprobs,
            finish_reason=done.completion.finish_reason,
            weight_version=done.weight_version,
            text=text,
            token_texts=token_texts,
            e2e_latency_s=latency_s,
            routed_experts=done.completion.routed_experts,
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        # Busy, paused or asleep means alive; otherwise prove it by generating one token.
        if self.engine.paused or self.engine.released_tags or self.engine.num_running > 0:
            return web.Response(status=200)
        greedy_one = SamplingParams(max_new_tokens=1, temperature=0.0)
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        try:
            future = asyncio.wrap_future(self.engine.submit(rid, (0,), greedy_one))
            await asyncio.wait_for(future, _HEALTH_TIMEOUT_S)
        except Exception:
            self.engine.abort(rid)
            return web.Response(status=503)
        return web.Response(status=200)

    # ---- control ----

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")  # there is no prefix cache to flush

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        self.engine.abort(str(body.get("rid") or ""), abort_all=bool(body.get("abort_all")))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await json_object(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response({"error": f"unknown pause mode {mode!r}"}, status=400)
        pause = functools.partial(self.engine.pause, abort_running=mode == "abort")
        await asyncio.get_running_loop().run_in_executor(None, pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ---- weights ----

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        if self.weight_session_open:
            return outcome(
                False, "a weight-update session is already open; call end_weight_update() first"
            )
        self.weight_session_open = True
        return outcome(True, "Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self.weight_session_open:
            return outcome(
                False, "no weight-update session is open; call begin_weight_update() first"
            )
        self.weight_session_open = False
        return outcome(True, "Success")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return outcome(False, "model_path (a Hugging Face directory) is required")
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        loop = asyncio.get_running_loop()
        try:
            new_model = await loop.run_in_executor(None, load_hf_model, path)
            apply = functools.partial(_copy_all, source=new_model)
            await loop.run_in_executor(None, self._update, apply, body.get("weight_version"))
        except (OSError, ValueError, TimeoutError) as err:
            return outcome(False, f"Failed to update weights from {path}: {err}")
        self.model_path = path
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        if not self.weight_session_open:
            return outcome(
                False,
                "update_weights_from_tensor must run between begin_weight_update() "
                "and end_weight_update()",
            )
        loop = asyncio.get_running_loop()
        if request.content_type == TENSOR_CONTENT_TYPE:
            blob = await request.read()
            read = functools.partial(deserialize_named_tensors, blob)
            version = request.query.get("weight_version")
        else:
            body = await json_object(request)
            if "shared_memory" not in body:
                return outcome(
                    False,
                    "the embedded server takes the tensors in shared memory (a JSON body with "
                    f"shared_memory) or as a safetensors body (Content-Type "
                    f"{TENSOR_CONTENT_TYPE}); see megatron_grpo.embedded.weights, "
                    "not SGLang's serialized_named_tensors",
                )
            read = functools.partial(load_shared, body["shared_memory"])
            version = body.get("weight_version")
        try:
            named = await loop.run_in_executor(None, read)
            apply = functools.partial(copy_into_model, named_tensors=named, require_all=False)
            await loop.run_in_executor(None, self._update, apply, version)
        except (ValueError, TimeoutError) as err:
            return outcome(False, f"Failed to update weights from tensors: {err}")
        return outcome(True, "Success")

    def _update(self, apply: Any, weight_version: Any) -> None:
        version = None if weight_version is None else str(weight_version)
        self.engine.update_weights(
            apply, weight_version=version, timeout_s=self.weight_update_timeout_s
        )

    # ---- info ----

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else "",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "load_format": None,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else "",
                "max_context_length": self.max_context or 0,
                "version": SERVER_VERSION,
                "internal_states": [
                    {"num_running": self.engine.num_running, "num_queued": self.engine.num_queued}
                ],
                "host": self.host,
                "port": self.port,
                "disaggregation_mode": "null",
                "device": "cpu",
                "hostname": socket.gethostname(),
                "max_batch_size": self.engine.max_batch_size,
                "released_memory": list(self.engine.released_tags),
            }
        )


def _copy_all(model: PreTrainedModel, *, source: PreTrainedModel) -> None:
    copy_into_model(model, hf_weights(source), require_all=True)


@dataclass
class EmbeddedServerHandle:
    """A running embedded server; ``stop()`` ends it (connections in flight are dropped)."""

    url: str
    engine: GenerationEngine
    _loop: asyncio.AbstractEventLoop
    _runner: web.AppRunner
    _thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            cleanup.result(timeout=timeout_s)
        finally:
            self.engine.stop(timeout_s=timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)


def start_embedded_server(
    model_or_dir: PreTrainedModel | str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    weight_version: str = "default",
    seed: int = 0,
    max_batch_size: int = 64,
    generate_timeout_s: float = 3600.0,
    weight_update_timeout_s: float = 600.0,
    startup_timeout_s: float = 60.0,
    api_key: str | None = None,
) -> EmbeddedServerHandle:
    """Serve a model (a copy of the given object, or loaded from a HF directory) on host:port.

    ``port=0`` picks a free port; the handle's ``url`` has the real one. A
    directory's tokenizer is loaded when it has one (needed only for ``text``
    input and output text). With ``api_key`` requests must carry it (``auth.py``); a
    ``host`` beyond loopback needs one (ValueError).
    """
    check_api_key(api_key, host)
    model, model_path, tokenizer = _served_model(model_or_dir, tokenizer)
    engine = GenerationEngine(
        model,
        eos_token_ids=_eos_token_ids(model),
        weight_version=weight_version,
        seed=seed,
        max_batch_size=max_batch_size,
    )
    server = _Server(
        engine,
        tokenizer=tokenizer,
        model_path=model_path,
        generate_timeout_s=generate_timeout_s,
        weight_update_timeout_s=weight_update_timeout_s,
    )
    loop = asyncio.new_event_loop()
    # stop() drops requests in flight, as a dying server would: clients retry
    # elsewhere. (A shutdown_timeout of 0 would mean no limit at all in aiohttp.)
    runner = web.AppRunner(
        server.app(api_key), handler_cancellation=True, shutdown_timeout=0.05, access_log=None
    )
    started = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, host, port).start())
        except BaseException as err:  # reported to the starting thread below
            failure.append(err)
            started.set()
            loop.close()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=serve, name="embedded-http", daemon=True)
    thread.start()
    if not started.wait(timeout=startup_timeout_s) or failure:
        engine.stop()
        if failure:
            raise RuntimeError(f"embedded server failed to start on {host}:{port}") from failure[0]
        raise RuntimeError(f"embedded server did not start within {startup_timeout_s} s")
    server.host, server.port = runner.addresses[0][:2]
    reachable = "127.0.0.1" if host in ("", "0.0.0.0") else host
    return EmbeddedServerHandle(
        url=f"http://{reachable}:{server.port}",
        engine=engine,
        _loop=loop,
        _runner=runner,
        _thread=thread,
    )


def _served_model(
    model_or_dir: PreTrainedModel | str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None,
) -> tuple[PreTrainedModel, str, PreTrainedTokenizerBase | None]:
    """The model to serve, the ``model_path`` the server reports, and the tokenizer if any."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        model_path = str(model_or_dir)
        model = load_hf_model(model_path)
        if tokenizer is None and _has_tokenizer(Path(model_path)):
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        return model, model_path, tokenizer
    model_path = getattr(model_or_dir, "name_or_path", "") or "<in-memory model>"
    # A copy: the caller keeps its model, and weight updates here stay here.
    return copy.deepcopy(model_or_dir).float().eval(), model_path, tokenizer


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


async def _all_finished(futures: list[concurrent.futures.Future[Finished]]) -> list[Finished]:
    """The engine's results for a request's samples, in order. The event loop wakes once,
    when the last is done (not once a sample); cancelled, it cancels them all, which
    aborts them. The first failure is raised."""
    if not futures:
        return []
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    left = [len(futures)]
    lock = threading.Lock()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def one_done(_: concurrent.futures.Future[Finished]) -> None:
        with lock:  # the engine's thread and this loop's (a cancel) both finish futures
            left[0] -= 1
            last = left[0] == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake)

    for future in futures:
        future.add_done_callback(one_done)
    try:
        await waiter
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise
    return [future.result() for future in futures]
