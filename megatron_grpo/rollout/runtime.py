"""The main rank's handle on the rollout engines: clients, and the servers it started.

Engines: the embedded server inside this process, or SGLang servers, either
started here from ``launch_command`` (stopped again by ``close()``) or
attached to at ``urls``. With ``router_url`` the servers are registered with
sglang-router and generation goes through it, while weight updates go to
each server directly.

It owns one event loop for the clients' whole life (aiohttp sessions are
bound to the loop that made them), on a thread of its own (``io_loop.IOLoop``), so that
one thread can push weights while another waits for generations. It generates groups of
completions for the training loop, and keeps the engines in use that a weight push opens
and closes (``weight_sync.engines``).

SGLang engines that stop answering are dropped: before each rollout, those that fail
``/health``; during a weight push, those that fail it and no longer answer. The step goes
on with the others (a generation request that fails is retried on the next engine). A
dropped engine that answers ``/health`` again is taken back at the next push, which
gives it the current weights. With no engine left during a push, the push waits up to
``rollout.engines.startup_timeout_s`` for one to come back; before a rollout, or past that,
the run stops with an error that says so (an engine that comes back holds old weights, and
only a push can replace them).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from megatron_grpo.config import ModelConfig, RolloutConfig
from megatron_grpo.rollout.io_loop import IOLoop

if TYPE_CHECKING:
    from megatron_grpo.embedded.server import EmbeddedServerHandle
    from megatron_grpo.rollout.client import ClientConfig
    from megatron_grpo.rollout.servers import ServerGroup

logger = logging.getLogger(__name__)


class GenerationHolder(Protocol):
    """Another process that generates with a runtime's engines (``rollout/producer.py``)."""

    def hold(self) -> None:
        """Before a weight update (returns once done): samples not yet sent wait, and
        those the pause aborts are sent again after ``release``."""

    def release(self, urls: tuple[str, ...]) -> None:
        """After a weight update: held samples go on, with the engines at ``urls``."""


class RolloutRuntime:
    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        hf_model=None,
        tokenizer=None,
        seed: int = 0,
        weight_version: str = "0",
        model_path: str | None = None,
        model_cfg: ModelConfig | None = None,
        attach_to: tuple[str, ...] | None = None,
        routed_layers: int | None = None,
    ):
        """``model_path`` fills ``{model}`` in ``cfg.engines.launch_command``; ``model_cfg``
        (and its ``hf_family``) names the model in the directory a ``disk`` push writes.

        ``attach_to``: the engines (and ``cfg.engines.router_url``) that another process's runtime
        started and pushes weights to; this one generates with them and starts, registers
        and stops nothing (the rollout producer's process). ``routed_layers``: the policy's
        layer count, which the routes of ``cfg.return_routed_experts`` have."""
        from megatron_grpo.rollout.client import SGLangClient

        self.cfg = cfg
        self.model_cfg = model_cfg
        self.server: EmbeddedServerHandle | None = None
        self.servers: ServerGroup | None = None
        self._model_dir: str | None = None
        self.holders: list[GenerationHolder] = []
        """Other processes that generate with these engines: a push holds them too."""
        generate_urls, weight_urls = self._start_engines(
            hf_model=hf_model,
            tokenizer=tokenizer,
            seed=seed,
            weight_version=weight_version,
            model_path=model_path,
            attach_to=attach_to,
        )
        self.io = IOLoop()

        if cfg.return_routed_experts and routed_layers is None:
            raise ValueError("rollout.return_routed_experts needs the policy's layer count")

        def client(urls: tuple[str, ...]) -> SGLangClient:
            config = client_config(cfg, urls)
            if cfg.return_routed_experts:
                config = dataclasses.replace(
                    config, return_routed_experts=True, num_layers=routed_layers
                )
            if cfg.engines.router_url is not None and urls == (cfg.engines.router_url,):
                config = dataclasses.replace(config, group_requests=False)  # the router's way

            async def opened() -> SGLangClient:
                return await SGLangClient(config).__aenter__()

            return self.io.run(opened())

        try:
            self.client = client(generate_urls)
            same = weight_urls == generate_urls
            self.weight_client = self.client if same else client(weight_urls)
        except BaseException:
            self.io.close()
            self._stop_engines()
            raise
        self._stopped = False
        # The engines in use change from the thread that generates (dropping silent ones)
        # and from the one that pushes weights (taking them back).
        self._engines = threading.RLock()
        self.dropped: list[str] = []
        """Engines out of use since they stopped answering."""

    def _start_engines(
        self, *, hf_model, tokenizer, seed, weight_version, model_path, attach_to
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Start or attach to the engines (``__init__``'s arguments); the URLs generation
        goes to, and those weight updates go to."""
        from megatron_grpo.embedded.server import start_embedded_server
        from megatron_grpo.rollout import engines
        from megatron_grpo.rollout.client_config import api_key_from_env
        from megatron_grpo.rollout.servers import ServerGroup

        cfg = self.cfg
        if attach_to is not None:
            self.servers = ServerGroup(urls=attach_to, router_url=cfg.engines.router_url)
            return self.servers.generate_urls, self.servers.urls
        if cfg.embedded_process:
            if self.model_cfg is None:
                raise ValueError("embedded server processes need the policy's model config")
            # The model directory stays until close(): an engine that exits starts again.
            self.servers, self._model_dir = engines.launch_embedded(cfg, self.model_cfg, seed=seed)
            return self.servers.urls, self.servers.urls
        if cfg.engines.type == "embedded":
            if hf_model is None:
                raise ValueError("the embedded rollout engine needs the policy as a HF model")
            self.server = start_embedded_server(
                hf_model,
                tokenizer=tokenizer,
                weight_version=weight_version,
                seed=seed,
                max_batch_size=max(cfg.prompts_per_step * cfg.samples_per_prompt, 1),
                api_key=api_key_from_env(cfg.engines.api_key_env),
            )
            return (self.server.url,), (self.server.url,)
        colocated = None
        if cfg.placement == "colocated" and cfg.engines.launch_command is not None:
            if self.model_cfg is None:
                raise ValueError("colocated engines need the policy's model config")
            colocated = engines.colocated_engines(cfg, self.model_cfg)
        self.servers = engines.start_or_attach(
            cfg.engines,
            model_path,
            routed_experts=bool(cfg.return_routed_experts),
            colocated=colocated,
        )
        return self.servers.generate_urls, self.servers.urls

    def check_routes(self, model_cfg: ModelConfig) -> None:
        """Before the first rollout: one token generated with routed experts, whose routes
        must be those of ``model_cfg`` (its layer count, top-k and expert count); a
        ValueError names what differs (an engine serving another model, a server started
        without ``--enable-return-routed-experts``)."""
        from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

        probe = RolloutRequest(
            prompts=((1, 2),), sampling=SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        (gen,) = self.io.run(self.client.generate(probe))
        check_engine_routes(gen.routed_experts, model_cfg)

    def generate_groups(
        self,
        prompts: list[list[int]],
        cfg: RolloutConfig,
        *,
        seed: int,
        stop_token_ids: list[int],
        on_group: Callable[[int, list[Any]], None] | None = None,
    ) -> list[list[Any]]:
        """cfg.samples_per_prompt completions of each prompt, grouped by prompt.

        ``on_group(prompt_index, group)`` is called with each group as soon as its last
        sample is done (on the runtime's event loop thread: it must not block)."""
        from megatron_grpo.rollout.episode import sampling_params
        from megatron_grpo.sglang_api.types import RolloutRequest

        request = RolloutRequest(
            prompts=tuple(tuple(p) for p in prompts),
            num_samples=cfg.samples_per_prompt,
            sampling=sampling_params(cfg, seed=seed, stop_token_ids=stop_token_ids),
        )
        from megatron_grpo.sglang_api.errors import RolloutStoppedError

        if self._stopped:
            raise RolloutStoppedError("the rollout engines' generation was stopped")
        self.drop_silent_engines("before a rollout")
        try:  # interrupted (Ctrl-C), the generation is cancelled: that aborts what is in flight
            flat = self.io.run(self.client.generate(request, _grouped(on_group, cfg)))
        finally:
            # Whatever ended it, the aborts it asked for reach the servers before we go on.
            self.io.run(self.client.settle())
        groups: list[list[Any]] = [[None] * cfg.samples_per_prompt for _ in prompts]
        for s in flat:
            groups[s.prompt_index][s.sample_index] = s
        return groups

    def run_on_engines(self, work: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        """``await work(client)`` on the runtime's event loop, as a rollout (a rollout hook's
        episodes): silent engines dropped first, what is in flight aborted if interrupted."""
        from megatron_grpo.sglang_api.errors import RolloutStoppedError

        if self._stopped:
            raise RolloutStoppedError("the rollout engines' generation was stopped")
        self.drop_silent_engines("before a rollout")
        try:
            return self.io.run(work(self.client))
        finally:
            self.io.run(self.client.settle())

    def stop_generation(self) -> None:
        """Cancel the generations running (their requests are aborted) and refuse new ones:
        for a thread that generates, from another, at the end of a run."""
        self._stopped = True
        self.io.cancel_running()

    def run_or_drop(self, call: Callable[[bool], Coroutine[Any, Any, None]], why: str) -> None:
        """Run ``call(again=False)`` (control calls to every engine in use); on failure drop
        the engines that no longer answer and run ``call(again=True)`` on the others."""
        from megatron_grpo.sglang_api.errors import RolloutError

        again = False
        while True:
            try:
                self.io.run(call(again))
                return
            except RolloutError as err:
                if not self.drop_silent_engines(f"{why} failed: {err}", wait=True):
                    raise
                again = True

    # ---- engines that stop answering ----

    def _answers(self, url: str) -> bool:
        from megatron_grpo.rollout.servers import http_ok

        return http_ok(f"{url}/health", timeout_s=self.weight_client.config.control_timeout_s)

    def drop_silent_engines(self, why: str, *, wait: bool = False) -> list[str]:
        """Stop using the SGLang engines that do not answer ``/health``; the ones dropped.

        When none is left: with ``wait`` (a push, which can give a returning engine the
        weights), wait up to ``rollout.engines.startup_timeout_s`` for one to answer; else
        stop."""
        if self.servers is None:  # the embedded server lives and dies with this process
            return []
        with self._engines:
            return self._drop_silent(why, wait=wait)

    def _drop_silent(self, why: str, *, wait: bool) -> list[str]:
        from megatron_grpo.sglang_api.errors import ServerUnavailableError

        silent = [u for u in self.weight_client.urls if not self._answers(u)]
        if not silent:
            return []
        left = [u for u in self.weight_client.urls if u not in silent]
        if not left and wait:
            left = self._wait_for_an_engine()
            silent = [u for u in self.weight_client.all_urls if u not in left]
        if not left:
            raise ServerUnavailableError(
                f"every rollout engine stopped answering ({', '.join(silent)}; {why}); restart "
                "them and resume the run from its last checkpoint"
            )
        logger.warning(
            "dropping rollout engine(s) %s, which stopped answering (%s); going on with %d",
            ", ".join(silent),
            why,
            len(left),
        )
        self.dropped = sorted(set(self.dropped) | set(silent))
        self._use(left)
        return silent

    def _wait_for_an_engine(self) -> list[str]:
        """The engines that answer within ``engines.startup_timeout_s``; [] if none does."""
        import time

        deadline = time.monotonic() + self.cfg.engines.startup_timeout_s
        logger.warning(
            "every rollout engine stopped answering; waiting up to %g s "
            "(rollout.engines.startup_timeout_s) for one to come back",
            self.cfg.engines.startup_timeout_s,
        )
        while time.monotonic() < deadline:
            back = [u for u in self.weight_client.all_urls if self._answers(u)]
            if back:
                return back
            time.sleep(1.0)
        return []

    def take_back_engines(self) -> None:
        """Start again the engines started here whose process exited, and use again the
        dropped engines that answer ``/health`` (the push to come gives them the current
        weights)."""
        if self.servers is None:
            return
        with self._engines:
            self.servers.restart_exited()
            back = [u for u in self.dropped if self._answers(u)]
            if not back:
                return
            logger.warning("taking back rollout engine(s) %s, which answer again", ", ".join(back))
            self.dropped = [u for u in self.dropped if u not in back]
            self._use([*self.weight_client.urls, *back])

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """Every engine's own URL, those out of use included."""
        if self.servers is not None:
            return self.servers.urls
        assert self.server is not None
        return (self.server.url,)

    def use_engines(self, urls: tuple[str, ...]) -> None:
        """Generate with the engines at ``urls`` only (those another process's pushes use)."""
        with self._engines:
            self.dropped = [u for u in self.weight_client.all_urls if u not in urls]
            self._use(list(urls))

    def _use(self, urls: list[str]) -> None:
        # Generation too, unless a router stands in front of the engines (it routes around
        # silent ones itself).
        self.weight_client.use_only(urls)

    def close(self) -> None:
        try:
            for client in {id(c): c for c in (self.client, self.weight_client)}.values():
                self.io.run(client.close())
            self.io.close()
        finally:
            self._stop_engines()

    def _stop_engines(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.servers is not None:
            self.servers.stop()
        if self._model_dir is not None:
            shutil.rmtree(self._model_dir, ignore_errors=True)


def check_engine_routes(routes: Any, model_cfg: ModelConfig) -> None:
    """A ValueError naming what differs between an engine's routes [positions, layers,
    top-k] and the policy ``model_cfg`` (routing replay replays them in its routers)."""
    if routes is None:
        raise ValueError(
            "the engines returned no routed experts with rollout.return_routed_experts"
        )
    layers, top_k = routes.shape[1:]
    want = (model_cfg.num_layers, model_cfg.moe_router_topk)
    if (layers, top_k) != want:
        raise ValueError(
            f"the engines route over {layers} layers x top-{top_k}, the policy over "
            f"model.num_layers={want[0]} x model.moe_router_topk={want[1]}: they serve "
            "another model (routing replay needs the policy's)"
        )
    experts = model_cfg.num_experts or 0
    if routes.size and int(routes.max()) >= experts:
        raise ValueError(
            f"the engines routed a token to expert {int(routes.max())}, the policy has "
            f"model.num_experts={experts}: they serve another model"
        )


def client_config(cfg: RolloutConfig, urls: tuple[str, ...]) -> ClientConfig:
    """The client settings of ``cfg`` for the engines at ``urls``."""
    from megatron_grpo.rollout.client import ClientConfig
    from megatron_grpo.rollout.client_config import api_key_from_env

    return ClientConfig(
        urls=urls,
        api_key=api_key_from_env(cfg.engines.api_key_env),
        max_concurrency=cfg.client.max_concurrency,
        request_timeout_s=cfg.client.request_timeout_s,
        connect_timeout_s=cfg.client.connect_timeout_s,
        control_timeout_s=cfg.client.control_timeout_s,
        weight_update_timeout_s=cfg.client.weight_update_timeout_s,
    )


def _grouped(
    on_group: Callable[[int, list[Any]], None] | None, cfg: RolloutConfig
) -> Callable[[Any], None] | None:
    """A per-sample callback that calls ``on_group`` once a prompt's samples are all done."""
    if on_group is None:
        return None
    pending: dict[int, list[Any]] = {}

    def on_sample(gen: Any) -> None:
        group = pending.setdefault(gen.prompt_index, [None] * cfg.samples_per_prompt)
        group[gen.sample_index] = gen
        if all(g is not None for g in group):
            on_group(gen.prompt_index, pending.pop(gen.prompt_index))

    return on_sample
