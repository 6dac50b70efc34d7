"""SGLang servers as child processes (or attached by URL), and their sglang-router.

``launch_servers`` starts ``num_servers`` copies of a command template, e.g.::

    python -m sglang.launch_server --model-path {model} --host {host} --port {port}

with ``{port}`` (and ``{host}``, ``{index}``, ``{model}``) filled per server, and
``--api-key <key>`` appended when there is a key (SGLang takes it from its command line
only; the log shows it as ``***``).
Each server gets its own log file and its own process group, so that
stopping it reaches the scheduler and detokenizer processes it forks. The
servers start together; each is waited for until ``/health_generate`` (a
real one-token generation) answers 200. A server that exits or is not ready
in time stops them all and raises ``ServerStartError`` with its log's tail.

With a router URL, every server is registered with sglang-router
(``POST /workers {"url"}``) and waited for until the router lists it as
healthy; ``stop()`` removes them from the router again before stopping them.

Stopping is by process group id only: SIGTERM to the group, a grace period
for SGLang's own shutdown, then SIGKILL to whatever of the group is left.
Should this process die without stopping them (killed, or a crash that skips
``stop()``), Linux sends each server SIGTERM (``PR_SET_PDEATHSIG``), on
which SGLang stops its own processes; so start servers from a thread that
lives as long as they should (the main thread).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import string
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_grpo import http
from megatron_grpo.launch import die_with_parent, free_port

logger = logging.getLogger(__name__)

TEMPLATE_FIELDS = ("port", "host", "index", "model", "base_gpu_id")
"""The placeholders a launch command may use."""


class ServerStartError(RuntimeError):
    """A server exited or was not ready in time; the message ends with its log's tail."""


class RouterError(RuntimeError):
    """sglang-router refused a worker or did not report it healthy in time."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start the servers and how long to wait for them."""

    command: str
    """Command line template; see ``TEMPLATE_FIELDS`` for the placeholders it may use."""
    num_servers: int = 1
    """How many servers to start, each on its own port."""
    gpus_per_server: int = 1
    """GPUs each server takes: server ``index`` starts at GPU ``index * gpus_per_server``
    (``{base_gpu_id}``, SGLang's ``--base-gpu-id``)."""
    host: str = "127.0.0.1"
    """Address the servers listen on (``{host}``); the URLs use it too."""
    ports: tuple[int, ...] = ()
    """One port per server; empty picks free ports."""
    model: str | None = None
    """Value of ``{model}``; a template that uses ``{model}`` needs it."""
    log_dir: str
    """Where ``server_<index>.log`` goes (created if absent)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for the servers, on top of this process's."""
    startup_timeout_s: float = 300.0
    """Limit for all servers to answer ``/health_generate``."""
    stop_grace_s: float = 30.0
    """Wait after SIGTERM before SIGKILL."""
    router_url: str | None = None
    """sglang-router to register the servers with; None for no router."""
    api_key: str | None = field(default=None, repr=False)
    """Appended to the command as ``--api-key <key>`` (SGLang's flag) unless the command
    has an ``--api-key`` of its own; None appends nothing."""

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.ports and len(self.ports) != self.num_servers:
            raise ValueError(f"{len(self.ports)} ports for {self.num_servers} servers")
        used = template_fields(self.command)
        unknown = used - set(TEMPLATE_FIELDS)
        if unknown:
            raise ValueError(
                f"launch command uses unknown placeholders {sorted(unknown)}; "
                f"known: {list(TEMPLATE_FIELDS)} (write a literal brace as {{{{ or }}}})"
            )
        if "port" not in used:
            raise ValueError("launch command must contain {port}: each server needs its own")
        if "model" in used and self.model is None:
            raise ValueError("launch command uses {model} but no model path was given")
        if not self.startup_timeout_s > 0 or self.stop_grace_s < 0:
            raise ValueError("startup_timeout_s must be > 0 and stop_grace_s >= 0")


def template_fields(command: str) -> set[str]:
    """The placeholder names used in ``command``."""
    return {name for _, name, _, _ in string.Formatter().parse(command) if name is not None}


def server_argv(cfg: LaunchConfig, index: int, port: int) -> list[str]:
    """The argument vector of server ``index``."""
    values = {
        "port": port,
        "host": cfg.host,
        "index": index,
        "model": cfg.model,
        "base_gpu_id": index * cfg.gpus_per_server,
    }
    argv = shlex.split(cfg.command.format(**values))
    if cfg.api_key is not None and not _has_api_key_flag(argv):
        argv += ["--api-key", cfg.api_key]
    return argv


def _has_api_key_flag(argv: Sequence[str]) -> bool:
    return any(a in ("--api-key", "--api-key-env") or a.startswith("--api-key=") for a in argv)


def redacted(argv: Sequence[str], api_key: str | None) -> list[str]:
    """``argv`` with the API key shown as ``***``, for logs."""
    if not api_key:
        return list(argv)
    return [a.replace(api_key, "***") for a in argv]


# --------------------------------------------------------------------------- processes


@dataclass
class ServerProcess:
    """One started server: its URL, its process (the leader of its own group) and its log."""

    index: int
    url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float) -> None:
        stop_process_group(self.process, grace_s)


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group led by ``process``, SIGKILL to what is left after grace_s."""
    pgid = process.pid  # started with start_new_session: its own group, by its own id
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    # The leader may exit before the processes it forked: wait for the whole group.
    while time.monotonic() < deadline:
        process.poll()  # reap the leader, or it stays a group member as a zombie
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    logger.warning("process group %d still alive %.0f s after SIGTERM: SIGKILL", pgid, grace_s)
    _signal_group(pgid, signal.SIGKILL)
    process.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_one(cfg: LaunchConfig, index: int, port: int) -> ServerProcess:
    log_path = Path(cfg.log_dir) / f"server_{index}.log"
    argv = server_argv(cfg, index, port)
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(redacted(argv, cfg.api_key))}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **cfg.env},
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    host = "127.0.0.1" if cfg.host in ("", "0.0.0.0") else cfg.host
    url = f"http://{host}:{port}"
    return ServerProcess(index=index, url=url, process=process, log_path=log_path)


def _wait_ready(servers: Sequence[ServerProcess], timeout_s: float) -> None:
    """Until every server answers /health_generate; raises ServerStartError."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            code = server.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"server {server.index} ({server.url}) exited with code {code} before it "
                    f"was ready; last lines of {server.log_path}:\n{server.log_tail()}"
                )
            if http_ok(f"{server.url}/health_generate", timeout_s=10.0):
                logger.info("server %d ready at %s", server.index, server.url)
                waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            server = waiting[0]
            raise ServerStartError(
                f"server {server.index} ({server.url}) not ready after {timeout_s:.0f} s; "
                f"last lines of {server.log_path}:\n{server.log_tail()}"
            )
        if waiting:
            time.sleep(0.5)


# --------------------------------------------------------------------------- router


def register_with_router(router_url: str, urls: Sequence[str], *, timeout_s: float) -> None:
    """Add each worker URL to sglang-router and wait until it lists them all as healthy.

    A router that does not answer yet (still starting) is retried until the timeout.
    """
    router_url = router_url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        try:
            status, body = _http_json("POST", f"{router_url}/workers", {"url": pending[0]})
        except http.RequestError as err:
            if time.monotonic() > deadline:
                raise RouterError(f"{router_url} not reachable after {timeout_s:.0f} s") from err
            time.sleep(0.5)
            continue
        if status not in (200, 201, 202):
            raise RouterError(f"{router_url} refused worker {pending[0]}: HTTP {status} {body}")
        pending.pop(0)
    while True:
        healthy = {w.get("url") for w in router_workers(router_url) if w.get("is_healthy")}
        if set(urls) <= healthy:
            return
        if time.monotonic() > deadline:
            raise RouterError(
                f"{router_url} does not list {sorted(set(urls) - healthy)} as healthy "
                f"after {timeout_s:.0f} s"
            )
        time.sleep(0.5)


def router_workers(router_url: str) -> list[dict[str, Any]]:
    """The workers sglang-router knows (its ``GET /workers`` list)."""
    status, body = _http_json("GET", f"{router_url.rstrip('/')}/workers")
    if status != 200 or not isinstance(body, dict):
        raise RouterError(f"{router_url}/workers answered HTTP {status}: {body}")
    return list(body.get("workers", []))


def deregister_from_router(router_url: str, urls: Sequence[str]) -> None:
    """Remove the workers with these URLs from sglang-router (``DELETE /workers/{id}``)."""
    router_url = router_url.rstrip("/")
    for worker in router_workers(router_url):
        if worker.get("url") in urls:
            status, body = _http_json("DELETE", f"{router_url}/workers/{worker['id']}")
            if status >= 300:
                raise RouterError(f"{router_url} did not remove {worker['url']}: {status} {body}")


# --------------------------------------------------------------------------- the group


@dataclass
class ServerGroup:
    """Servers to generate with: started here (``processes``) or attached to by URL."""

    urls: tuple[str, ...]
    """The servers' own URLs: weight updates go to each of them."""
    router_url: str | None = None
    """Where generation goes when set (the router spreads it over ``urls``)."""
    processes: list[ServerProcess] = field(default_factory=list)
    stop_grace_s: float = 30.0
    launch: LaunchConfig | None = None
    """How the servers were started (None: attached), to start again one that exited."""

    def restart_exited(self) -> list[str]:
        """Start again, on its port, every started server whose process exited; wait until
        each generates (and is back in the router). Their URLs."""
        exited = [p for p in self.processes if p.process.poll() is not None]
        if not exited or self.launch is None:
            return []
        for server in exited:
            logger.warning(
                "rollout server %d (%s) exited with code %s; starting it again. Last lines "
                "of %s:\n%s",
                server.index,
                server.url,
                server.process.returncode,
                server.log_path,
                server.log_tail(10),
            )
            port = int(server.url.rsplit(":", 1)[1])
            self.processes[self.processes.index(server)] = _start_one(
                self.launch, server.index, port
            )
        indices = {s.index for s in exited}
        again = [p for p in self.processes if p.index in indices]
        _wait_ready(again, self.launch.startup_timeout_s)
        if self.router_url:
            urls = [p.url for p in again]
            register_with_router(self.router_url, urls, timeout_s=self.launch.startup_timeout_s)
        return [p.url for p in again]

    @property
    def generate_urls(self) -> tuple[str, ...]:
        return (self.router_url,) if self.router_url else self.urls

    def stop(self) -> None:
        """Leave the router (servers started here only) and stop the started servers."""
        if not self.processes:
            return
        if self.router_url:
            try:
                deregister_from_router(self.router_url, [p.url for p in self.processes])
            except (RouterError, http.RequestError) as err:
                logger.warning("could not remove the servers from %s: %s", self.router_url, err)
        for server in self.processes:
            server.stop(self.stop_grace_s)
        self.processes = []

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def launch_servers(cfg: LaunchConfig) -> ServerGroup:
    """Start the servers, wait until each generates, register them with the router if any."""
    Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    ports = cfg.ports or tuple(free_port() for _ in range(cfg.num_servers))
    group = ServerGroup(
        urls=(), router_url=cfg.router_url, stop_grace_s=cfg.stop_grace_s, launch=cfg
    )
    try:
        for index, port in enumerate(ports):
            group.processes.append(_start_one(cfg, index, port))
        group.urls = tuple(p.url for p in group.processes)
        logger.info("started %d server(s), logs in %s", len(ports), cfg.log_dir)
        _wait_ready(group.processes, cfg.startup_timeout_s)
        if cfg.router_url:
            register_with_router(cfg.router_url, group.urls, timeout_s=cfg.startup_timeout_s)
    except BaseException:
        group.stop()
        raise
    return group


def attach_servers(
    urls: Sequence[str], *, router_url: str | None = None, timeout_s: float = 60.0
) -> ServerGroup:
    """Servers started elsewhere, once each answers ``/health`` (waiting up to ``timeout_s``
    for one that is still starting); registered with the router when one is given."""
    urls = tuple(u.rstrip("/") for u in urls)
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while not http_ok(f"{url}/health", timeout_s=min(10.0, timeout_s)):
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"no server answers {url}/health after {timeout_s:g} s "
                    "(rollout.engines.startup_timeout_s); is it started, and is the URL right?"
                )
            time.sleep(0.5)
    if router_url:
        register_with_router(router_url, urls, timeout_s=timeout_s)
    return ServerGroup(urls=urls, router_url=router_url)


# --------------------------------------------------------------------------- HTTP


def _http_json(method: str, url: str, body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any]:
    """(status, decoded JSON or text); no answer at all raises ``http.RequestError``."""
    reply = http.run_sync(http.request(method, url, body, timeout_s=timeout_s))
    try:
        return reply.status, reply.json()
    except ValueError:
        return reply.status, reply.text


def http_ok(url: str, *, timeout_s: float) -> bool:
    """Whether ``url`` answers a GET with 200 within ``timeout_s``."""
    try:
        reply = http.run_sync(http.request("GET", url, timeout_s=timeout_s))
    except http.RequestError:  # refused, reset or timed out while loading
        return False
    return reply.status == 200
