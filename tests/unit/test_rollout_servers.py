"""Server management with stand-in processes: templates, readiness, failures, stopping, router.

The servers are ``fake_server_process.py`` (an HTTP process that forks
children into its process group, as SGLang does); the router is a small
in-process HTTP server with sglang-router's worker API. The real SGLang
server and the real sglang-router are exercised in tests/sglang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from engine_push import push_weights

from megatron_grpo.config import (
    EngineClientConfig,
    EnginesConfig,
    RolloutConfig,
    WeightSyncConfig,
)
from megatron_grpo.launch import free_port
from megatron_grpo.rollout.servers import (
    LaunchConfig,
    RouterError,
    ServerStartError,
    attach_servers,
    launch_servers,
    register_with_router,
    router_workers,
    server_argv,
)

pytestmark = pytest.mark.timeout(60)

FAKE = f"{sys.executable} {Path(__file__).with_name('fake_server_process.py')}"


def fake_config(tmp_path, options: str = "", **kwargs) -> LaunchConfig:
    return LaunchConfig(
        command=f"{FAKE} --host {{host}} --port {{port}} {options}",
        log_dir=str(tmp_path / "logs"),
        **{"startup_timeout_s": 30.0, "stop_grace_s": 5.0, **kwargs},
    )


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def pids_gone(pids: list[int], timeout_s: float = 5.0) -> bool:
    """True once none of ``pids`` is a live process (zombies of other parents count as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- templates


def test_template_fills_port_host_index_and_model(tmp_path):
    cfg = LaunchConfig(
        command="serve --model-path {model} --host {host} --port {port} --name s{index}",
        model="/ckpt dir",
        log_dir=str(tmp_path),
    )
    assert server_argv(cfg, 2, 30001) == [
        "serve",
        "--model-path",
        "/ckpt",
        "dir",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--name",
        "s2",
    ]


@pytest.mark.parametrize(
    "command, kwargs, message",
    [
        ("serve --port 30000", {}, "must contain {port}"),
        ("serve --port {port} --tp {tp}", {}, "unknown placeholders ['tp']"),
        ("serve --model-path {model} --port {port}", {}, "no model path"),
        ("serve --port {port}", {"num_servers": 0}, "num_servers must be >= 1"),
        ("serve --port {port}", {"num_servers": 2, "ports": (1,)}, "1 ports for 2 servers"),
    ],
)
def test_bad_launch_configs_are_refused(tmp_path, command, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LaunchConfig(command=command, log_dir=str(tmp_path), **kwargs)


# --------------------------------------------------------------------------- processes


def test_servers_start_on_their_own_ports_with_own_logs_and_stop_with_their_children(tmp_path):
    cfg = fake_config(tmp_path, "--children 2 --model {model}", num_servers=2, model="m0")
    group = launch_servers(cfg)
    try:
        assert len(set(group.urls)) == 2 and group.generate_urls == group.urls
        pids = []
        for server in group.processes:
            assert get_json(server.url + "/health_generate") == {}
            pids += get_json(server.url + "/pids")["pids"]
            assert f"port {server.url.rsplit(':', 1)[1]} model m0" in server.log_path.read_text()
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
            "server_0.log",
            "server_1.log",
        ]
        pgids = [s.process.pid for s in group.processes]
        assert len(pids) == 6
    finally:
        group.stop()
    assert all(group_gone(pgid) for pgid in pgids)
    assert pids_gone(pids)
    group.stop()  # a second stop is a no-op


def test_a_server_that_exits_fails_the_launch_with_its_log_tail(tmp_path):
    with pytest.raises(ServerStartError, match="exited with code 3") as info:
        launch_servers(fake_config(tmp_path, "--mode exit"))
    assert "failing on purpose" in str(info.value)


def test_a_server_that_never_generates_times_out_and_is_stopped(tmp_path):
    cfg = fake_config(tmp_path, "--mode never_ready --children 1", startup_timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready after 2 s") as info:
        launch_servers(cfg)
    assert time.monotonic() - start < 15
    assert "fake server: port" in str(info.value)


def test_the_other_servers_are_stopped_when_one_fails(tmp_path, monkeypatch):
    started = []
    import megatron_grpo.rollout.servers as servers

    original = servers._start_one

    def start_one(cfg, index, port):
        process = original(
            fake_config(tmp_path, "--mode exit" if index == 1 else "--ready-after 30"),
            index,
            port,
        )
        started.append(process)
        return process

    monkeypatch.setattr(servers, "_start_one", start_one)
    with pytest.raises(ServerStartError, match="server 1"):
        launch_servers(fake_config(tmp_path, num_servers=2))
    assert all(group_gone(p.process.pid) for p in started)


def test_stop_kills_a_group_that_ignores_sigterm_after_the_grace_period(tmp_path):
    group = launch_servers(fake_config(tmp_path, "--children 1 --ignore-term", stop_grace_s=1.0))
    pids = get_json(group.urls[0] + "/pids")["pids"]
    start = time.monotonic()
    group.stop()
    assert 1.0 <= time.monotonic() - start < 10
    assert pids_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_servers_get_sigterm_when_the_launching_process_is_killed(tmp_path):
    """A trainer that dies without stop() (SIGKILL here) does not leave its servers running."""
    import subprocess

    script = (
        "import sys, time\n"
        "from megatron_grpo.rollout.servers import LaunchConfig, launch_servers\n"
        f"group = launch_servers(LaunchConfig(command={fake_config(tmp_path).command!r}, "
        f"log_dir={str(tmp_path / 'logs')!r}))\n"
        "print(group.processes[0].process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        server_pid = int(launcher.stdout.readline())
        assert not pids_gone([server_pid], timeout_s=0.5)
    finally:
        launcher.kill()
        launcher.wait()
    assert pids_gone([server_pid], timeout_s=10)


# --------------------------------------------------------------------------- router


class FakeRouter:
    """sglang-router's worker API: POST/GET /workers, DELETE /workers/{id}; health via /health."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workers: dict[str, str] = {}  # id -> url
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                worker_id = uuid.uuid4().hex
                router.workers[worker_id] = body["url"]
                self._send(202, {"status": "accepted", "worker_id": worker_id})

            def do_GET(self) -> None:
                listed = [
                    {"id": i, "url": u, "is_healthy": _healthy(u)}
                    for i, u in router.workers.items()
                ]
                self._send(200, {"workers": listed, "total": len(listed)})

            def do_DELETE(self) -> None:
                found = router.workers.pop(self.path.rsplit("/", 1)[-1], None)
                self._send(202 if found else 404, {})

            def _send(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.handler = Handler
        self.httpd: ThreadingHTTPServer | None = None

    def start(self, delay_s: float = 0.0) -> None:
        def serve() -> None:
            time.sleep(delay_s)
            self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
            self.httpd.serve_forever()

        threading.Thread(target=serve, daemon=True).start()

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def fake_router():
    router = FakeRouter(free_port())
    yield router
    router.stop()


def test_launched_servers_join_a_router_that_starts_late_and_leave_it_on_stop(
    tmp_path, fake_router
):
    fake_router.start(delay_s=1.0)  # the router may come up while the servers load
    group = launch_servers(fake_config(tmp_path, num_servers=2, router_url=fake_router.url))
    try:
        assert sorted(w["url"] for w in router_workers(fake_router.url)) == sorted(group.urls)
        assert group.generate_urls == (fake_router.url,)
    finally:
        group.stop()
    assert router_workers(fake_router.url) == []


def test_attached_servers_join_the_router_and_stay_on_stop(tmp_path, fake_router):
    fake_router.start()
    launched = launch_servers(fake_config(tmp_path))
    try:
        attached = attach_servers(list(launched.urls), router_url=fake_router.url)
        attached.stop()  # started elsewhere: not ours to stop or remove
        assert [w["url"] for w in router_workers(fake_router.url)] == list(launched.urls)
        assert launched.processes[0].process.poll() is None
    finally:
        launched.stop()


def test_router_registration_times_out_on_an_unhealthy_worker(fake_router):
    fake_router.start()
    with pytest.raises(RouterError, match="as healthy"):
        register_with_router(fake_router.url, [f"http://127.0.0.1:{free_port()}"], timeout_s=1.0)


def test_an_unreachable_router_fails_after_the_timeout():
    with pytest.raises(RouterError, match="not reachable"):
        register_with_router(f"http://127.0.0.1:{free_port()}", ["http://x"], timeout_s=1.0)


# --------------------------------------------------------------------------- runtime


def test_runtime_launches_from_the_config_and_stops_on_close(tmp_path, fake_router):
    from megatron_grpo.rollout.runtime import RolloutRuntime

    fake_router.start()
    cfg = RolloutConfig(
        engines=EnginesConfig(
            type="sglang",
            launch_command=f"{FAKE} --host {{host}} --port {{port}} --model {{model}} --children 1",
            num_servers=2,
            log_dir=str(tmp_path / "logs"),
            router_url=fake_router.url,
        )
    )
    runtime = RolloutRuntime(cfg, model_path="/some/model")
    servers = runtime.servers
    assert servers is not None
    assert runtime.client.urls == (fake_router.url,)
    assert runtime.weight_client.urls == servers.urls and len(servers.urls) == 2
    assert "model /some/model" in (tmp_path / "logs" / "server_1.log").read_text()
    pgids = [p.process.pid for p in servers.processes]
    runtime.close()
    assert all(group_gone(pgid) for pgid in pgids)
    assert router_workers(fake_router.url) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"type": "sglang"}, "needs rollout.engines.urls or rollout.engines.launch_command"),
        ({"type": "sglang", "urls": ["http://a:1"], "launch_command": "x {port}"}, "not both"),
        ({"type": "sglang", "launch_command": "x {port}", "num_servers": 0}, "num_servers"),
    ],
)
def test_rollout_config_checks_the_server_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(engines=EnginesConfig(**kwargs))


def engine_that_hangs(tmp_path, *, request_timeout_s: float):
    """A runtime on one fake engine that never answers /generate and logs each
    /abort_request to the returned file; (runtime, config, abort log)."""
    from megatron_grpo.rollout.runtime import RolloutRuntime

    aborts = tmp_path / "aborts.jsonl"
    cfg = RolloutConfig(
        engines=EnginesConfig(
            type="sglang",
            launch_command=f"{FAKE} --host {{host}} --port {{port}} --abort-log {aborts}",
            log_dir=str(tmp_path / "logs"),
        ),
        prompts_per_step=1,
        samples_per_prompt=2,
        client=EngineClientConfig(request_timeout_s=request_timeout_s),
    )
    return RolloutRuntime(cfg, model_path="/some/model"), cfg, aborts


def test_a_hung_generation_is_aborted_on_its_server_before_the_error_returns(tmp_path):
    """The server never answers /generate: after request_timeout_s the runtime raises, and
    by then every sample's /abort_request has reached the server (not left to a task that
    dies with the event loop)."""
    from megatron_grpo.sglang_api.errors import RolloutBatchError

    runtime, cfg, aborts = engine_that_hangs(tmp_path, request_timeout_s=1.0)
    try:
        with pytest.raises(RolloutBatchError) as e:
            runtime.generate_groups([[1, 2, 3]], cfg, seed=0, stop_token_ids=[])
        assert "request_timeout_s=1.0" in str(e.value)
        rids = sorted(json.loads(line)["rid"] for line in aborts.read_text().splitlines())
        assert len(rids) == 2 and len(set(rids)) == 2
    finally:
        runtime.close()


def test_attaching_waits_for_a_server_that_is_still_starting(tmp_path):
    from megatron_grpo.rollout.servers import ServerStartError, attach_servers

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ServerStartError, match=rf"no server answers {url}/health after 1 s"):
        attach_servers([url], timeout_s=1.0)
    late = threading.Timer(
        1.5,
        lambda: started.append(
            subprocess.Popen([*FAKE.split(), "--port", str(port)], start_new_session=True)
        ),
    )
    started: list = []
    late.start()
    try:
        t0 = time.monotonic()
        assert attach_servers([url], timeout_s=60.0).urls == (url,)
        assert time.monotonic() - t0 >= 1.5
    finally:
        late.join()
        for process in started:
            process.kill()
            process.wait()


def test_ctrl_c_during_a_generation_aborts_it_on_the_server(tmp_path):
    """SIGINT while the server is generating: KeyboardInterrupt reaches the caller, and the
    requests in flight have been cancelled and aborted on the server by then."""
    import signal

    runtime, cfg, aborts = engine_that_hangs(tmp_path, request_timeout_s=60.0)
    # To this (the main) thread, as a terminal's Ctrl-C would: it interrupts the event loop.
    main = threading.main_thread().ident
    interrupt = threading.Timer(1.0, signal.pthread_kill, args=(main, signal.SIGINT))
    # Python's own Ctrl-C handler, whatever an earlier test of this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt.start()
        with pytest.raises(KeyboardInterrupt):
            runtime.generate_groups([[1, 2, 3]], cfg, seed=0, stop_token_ids=[])
        rids = {json.loads(line)["rid"] for line in aborts.read_text().splitlines()}
        assert len(rids) == 2
    finally:
        interrupt.join()
        signal.signal(signal.SIGINT, previous)
        runtime.close()


def test_a_dead_engine_is_dropped_and_taken_back_once_it_answers(tmp_path):
    """Two engines (embedded servers attached as SGLang engines, weights by disk). One is
    stopped: the next push drops it and the rollouts go on, complete, on the other. Started
    again on its port, it is taken back at the next push, which gives it the weights. With
    every engine stopped, a push waits for one to come back, and fails saying so when none
    does."""
    from megatron_grpo.config.hf import model_config_from_hf
    from megatron_grpo.embedded.server import start_embedded_server
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.sglang_api.errors import ServerUnavailableError
    from megatron_grpo.testing import random_hf_model, tiny_hf_config

    hf_config = tiny_hf_config("qwen2")
    model = random_hf_model(hf_config, seed=0)
    model_cfg = model_config_from_hf(hf_config)
    named = dict(model.state_dict())
    engines = [start_embedded_server(model, seed=0) for _ in range(2)]
    cfg = RolloutConfig(
        engines=EnginesConfig(type="sglang", urls=[e.url for e in engines], startup_timeout_s=8.0),
        sync=WeightSyncConfig(method="disk"),
        prompts_per_step=2,
        samples_per_prompt=2,
        max_new_tokens=4,
        client=EngineClientConfig(control_timeout_s=5.0),
    )
    runtime = RolloutRuntime(cfg, model_cfg=model_cfg)
    prompts = [[1, 2, 3], [4, 5]]

    def push(version: str) -> None:
        push_weights(runtime, named, weight_version=version)

    def rollout() -> list:
        groups = runtime.generate_groups(prompts, cfg, seed=0, stop_token_ids=[])
        return [s for g in groups for s in g]

    try:
        assert len(rollout()) == 4
        engines[1].stop()
        push("1")
        assert runtime.dropped == [engines[1].url] and runtime.client.urls == (engines[0].url,)
        samples = rollout()
        assert len(samples) == 4 and {s.weight_version for s in samples} == {"1"}

        port = int(engines[1].url.rsplit(":", 1)[1])
        engines[1] = start_embedded_server(model, port=port, seed=0, weight_version="stale")
        push("2")
        assert runtime.dropped == [] and runtime.client.urls == tuple(e.url for e in engines)
        assert all(e.engine.weight_version == "2" for e in engines)
        assert {s.weight_version for s in rollout()} == {"2"}

        # Every engine stopped: the push waits for one to come back and gives it the weights.
        for engine in engines:
            engine.stop()
        ports = [int(e.url.rsplit(":", 1)[1]) for e in engines]

        def restart_first() -> None:
            engines[0] = start_embedded_server(model, port=ports[0], seed=0)

        later = threading.Timer(2.0, restart_first)
        later.start()
        push("3")
        later.join()
        assert runtime.dropped == [engines[1].url] and engines[0].engine.weight_version == "3"
        # ... and gives up after rollout.engines.startup_timeout_s when none does.
        engines[0].stop()
        with pytest.raises(ServerUnavailableError, match="every rollout engine stopped"):
            push("4")
    finally:
        for engine in engines:
            engine.stop()
        runtime.close()
