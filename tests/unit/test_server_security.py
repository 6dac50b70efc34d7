"""The embedded server trusts no one: shared-memory files it did not make are not read,
and with an API key nothing but the liveness probes answers a request without it.

The shared-memory attacks are the audit's: a name in world-writable ``/dev/shm`` that
is a link to another file (or a file someone else left there) would be mapped and loaded
into a weight, which ``/get_weights_by_name`` then hands back, i.e. any file readable by
the server's user could be read through the port.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_grpo.config import EnginesConfig, RolloutConfig
from megatron_grpo.embedded import auth
from megatron_grpo.embedded.server import start_embedded_server
from megatron_grpo.embedded.weights import (
    SHM_DIR,
    SHM_PREFIX,
    SharedFileRefused,
    map_shared_file,
    shared_bucket,
    tensor_update,
)
from megatron_grpo.rollout.client import ClientConfig, SGLangClient
from megatron_grpo.sglang_api.errors import RolloutBatchError, RolloutHTTPError
from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]

KEY = "k3y-" + uuid.uuid4().hex
TARGET = "model.norm.weight"  # 64 float32s: 256 bytes
SECRET = (b"TOP-SECRET-" * 24)[:256]
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0)


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(config).eval()


def call(url, path, body=None, *, key=None, method="POST"):
    """(status, decoded JSON or text, raw bytes) of one request, with ``key`` if given."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw), raw
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace"), raw


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2()


@pytest.fixture
def server(model):
    handle = start_embedded_server(model, seed=0)
    yield handle
    handle.stop()


@pytest.fixture
def keyed_server(model):
    handle = start_embedded_server(model, seed=0, api_key=KEY)
    yield handle
    handle.stop()


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.bin"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def shm_names():
    """Paths under /dev/shm a test makes; removed afterwards, whatever they are."""
    made: list[Path] = []
    yield made
    for path in reversed(made):
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            for child in path.iterdir():
                child.unlink()
            path.rmdir()


def shm_request(path, weight_version="evil"):
    """An update that would load the file's first 256 bytes into TARGET."""
    tensors = [{"name": TARGET, "dtype": "float32", "shape": [64], "offset": 0}]
    return {
        "shared_memory": {"path": str(path), "tensors": tensors},
        "weight_version": weight_version,
    }


def try_to_load(url, path, key=None):
    """Send the update inside a session and read TARGET back: (status, answer, all bytes
    the server sent, TARGET's bytes as the server holds it afterwards)."""
    assert call(url, "/begin_weight_update", {}, key=key)[0] == 200
    status, answer, raw = call(url, "/update_weights_from_tensor", shm_request(path), key=key)
    assert call(url, "/end_weight_update", {}, key=key)[0] == 200
    _, values, raw_values = call(url, "/get_weights_by_name", {"name": TARGET}, key=key)
    held = torch.tensor(values, dtype=torch.float32).numpy().tobytes()
    return status, answer, raw + raw_values, held


def assert_refused(url, path, reason, model, key=None):
    status, answer, raw, held = try_to_load(url, path, key)
    assert status == 400 and answer["success"] is False, answer
    assert reason in answer["message"], answer["message"]
    assert SECRET not in raw and SECRET[:16] not in held  # nothing was read
    assert held == model.state_dict()[TARGET].numpy().tobytes()


# ---- shared memory: only files of the server's own user, in a private directory ----


def test_a_link_in_shm_to_another_file_is_not_read(server, model, secret, shm_names):
    """The audit's attack: /dev/shm/mgrpo_weights_* made a link to any file."""
    link = SHM_DIR / f"{SHM_PREFIX}{uuid.uuid4().hex}"
    link.symlink_to(secret)
    shm_names.append(link)
    assert_refused(server.url, link, "must be a /dev/shm/mgrpo_weights_*/<file>", model)


def test_a_link_inside_a_private_bucket_directory_is_not_followed(server, model, secret, shm_names):
    bucket = shared_bucket({TARGET: torch.zeros(64)})
    link = bucket.path.parent / "link"
    try:
        link.symlink_to(secret)
        assert_refused(server.url, link, "is a symbolic link", model)
    finally:
        link.unlink(missing_ok=True)
        bucket.close()
    # A private-looking directory that is a link to one of the attacker's choosing.
    elsewhere = Path(tempfile.mkdtemp(dir=secret.parent))
    (elsewhere / "bucket").write_bytes(SECRET)
    dir_link = SHM_DIR / f"{SHM_PREFIX}{uuid.uuid4().hex}"
    dir_link.symlink_to(elsewhere, target_is_directory=True)
    shm_names.append(dir_link)
    assert_refused(server.url, dir_link / "bucket", "its directory is a symbolic link", model)


def test_a_file_the_server_was_not_handed_is_refused(server, model, shm_names):
    """A file left in /dev/shm (anyone may write there), or in a directory others may
    enter, is not a bucket of this server's senders."""
    loose = SHM_DIR / f"{SHM_PREFIX}{uuid.uuid4().hex}"
    loose.write_bytes(SECRET)
    shm_names.append(loose)
    assert_refused(server.url, loose, "made by shared_bucket", model)

    shared_dir = SHM_DIR / f"{SHM_PREFIX}{uuid.uuid4().hex}"
    shared_dir.mkdir(mode=0o755)
    shared_dir.chmod(0o755)
    shm_names.append(shared_dir)
    (shared_dir / "bucket").write_bytes(SECRET)
    assert_refused(server.url, shared_dir / "bucket", "open to other users (want 700)", model)

    with pytest.raises(SharedFileRefused, match="made by shared_bucket"):
        map_shared_file(SHM_DIR / f"{SHM_PREFIX}x" / ".." / ".." / "etc" / "passwd")
    with pytest.raises(SharedFileRefused, match="does not exist"):
        map_shared_file(SHM_DIR / f"{SHM_PREFIX}{uuid.uuid4().hex}" / "bucket")


@pytest.mark.skipif(os.getuid() != 0, reason="making a file of another user needs root")
def test_a_file_of_another_user_is_refused(server, model, shm_names):
    bucket = shared_bucket({TARGET: torch.ones(64)})
    try:
        os.chown(bucket.path, 65534, 65534)
        assert_refused(server.url, bucket.path, "owned by uid 65534", model)
        os.chown(bucket.path.parent, 65534, 65534)
        with pytest.raises(SharedFileRefused, match="its directory is owned by uid 65534"):
            map_shared_file(bucket.path)
    finally:
        bucket.close()


def test_a_bucket_made_by_shared_bucket_still_loads(server):
    values = torch.arange(64, dtype=torch.float32)
    bucket = shared_bucket({TARGET: values})
    try:
        assert bucket.path.parent.parent == SHM_DIR
        assert bucket.path.parent.stat().st_mode & 0o777 == 0o700
        status, answer, _, held = try_to_load(server.url, bucket.path)
    finally:
        bucket.close()
    assert status == 200 and answer["success"] is True
    assert held == values.numpy().tobytes()
    assert not bucket.path.parent.exists()


# ---- the API key ----


def test_without_the_key_every_endpoint_but_health_answers_401(keyed_server):
    url = keyed_server.url
    endpoints = [
        ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
        ("POST", "/begin_weight_update", {}),
        ("POST", "/update_weights_from_tensor", shm_request("/etc/passwd")),
        ("POST", "/update_weights_from_disk", {"model_path": "/"}),
        ("POST", "/get_weights_by_name", {"name": TARGET}),
        ("OPTIONS", "/get_weights_by_name", {"name": TARGET}),
        ("POST", "/weights_checksum", {"names": [TARGET], "dtypes": ["float32"]}),
        ("POST", "/init_weights_update_group", {}),
        ("POST", "/pause_generation", {}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("GET", "/server_info", None),
        ("GET", "/model_info", None),
        ("POST", "/no_such_endpoint", {}),
    ]
    for method, path, body in endpoints:
        for key in (None, "wrong", KEY + "x", ""):
            status, answer, _ = call(url, path, body, key=key, method=method)
            assert status == 401, (method, path, key, status, answer)
            assert "Unauthorized" in answer["error"]
    assert not keyed_server.engine.paused
    for path in ("/health", "/health_generate"):
        assert call(url, path, method="GET")[0] == 200
    assert call(url, "/server_info", key=KEY, method="GET")[0] == 200
    assert call(url, "/begin_weight_update", {}, key=KEY)[0] == 200
    assert call(url, "/end_weight_update", {}, key=KEY)[0] == 200


def test_the_client_sends_the_key(keyed_server, model):
    url = keyed_server.url
    values = torch.full((64,), 0.5)
    bucket = shared_bucket({TARGET: values})

    async def with_key():
        async with SGLangClient(ClientConfig(urls=(url,), api_key=KEY)) as client:
            samples = await client.generate(RolloutRequest(prompts=((1, 2, 3),), sampling=GREEDY))
            await client.begin_weight_update()
            await client.update_weights_from_tensor(bucket.request(weight_version="2"), url=url)
            body = tensor_update({TARGET: values}, weight_version="3")
            await client.update_weights_from_tensor(body, url=url)
            await client.end_weight_update()
            read = await client.get_weights_by_name(TARGET, truncate_size=64, url=url)
            return samples, read, await client.model_info()

    async def without_key():
        async with SGLangClient(ClientConfig(urls=(url,), max_retries=0)) as client:
            with pytest.raises(RolloutHTTPError) as refused:
                await client.begin_weight_update()
            assert refused.value.status == 401
            with pytest.raises(RolloutBatchError, match="HTTP 401"):
                await client.generate(RolloutRequest(prompts=((1, 2),), sampling=GREEDY))

    try:
        samples, read, info = asyncio.run(with_key())
        asyncio.run(without_key())
    finally:
        bucket.close()
    assert len(samples) == 1 and len(samples[0].output_ids) == 3
    assert read == values.tolist() and info["weight_version"] == "3"
    assert KEY not in repr(ClientConfig(urls=(url,), api_key=KEY))


def test_the_key_is_compared_whole():
    assert auth.authorized(f"Bearer {KEY}", KEY)
    for header in (None, KEY, f"bearer {KEY}", f"Bearer {KEY} ", f"Bearer {KEY[:-1]}", "Bearer"):
        assert not auth.authorized(header, KEY)
    assert not auth.authorized("Bearer \udcff", KEY)  # undecodable bytes, as aiohttp gives them


def test_a_server_beyond_loopback_needs_a_key(model):
    for host in ("0.0.0.0", "", "::", "10.1.2.3", "myhost"):
        with pytest.raises(ValueError, match="--api-key.*rollout.engines.api_key_env"):
            start_embedded_server(model, host)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        auth.check_api_key(None, host)
    with pytest.raises(ValueError, match="printable ASCII"):
        start_embedded_server(model, api_key="")


def test_the_command_line_server_refuses_to_listen_beyond_loopback_without_a_key(
    capsys, monkeypatch
):
    from megatron_grpo.embedded.__main__ import main

    with pytest.raises(SystemExit):
        main(["--model-path", "/nonexistent", "--host", "0.0.0.0"])
    assert "--api-key" in capsys.readouterr().err
    monkeypatch.delenv("MGRPO_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(SystemExit):
        main(["--model-path", "/nonexistent", "--api-key-env", "MGRPO_TEST_NO_SUCH_KEY"])
    assert "MGRPO_TEST_NO_SUCH_KEY is not set" in capsys.readouterr().err


# ---- the trainer's side: the key from rollout.engines.api_key_env, never in the config ----


def test_rollout_config_takes_the_name_of_the_key_not_the_key(monkeypatch):
    from megatron_grpo.config.loader import dump_config
    from megatron_grpo.rollout.runtime import client_config

    beyond_loopback = dict(embedded_server="process", host="0.0.0.0")
    with pytest.raises(ValueError, match="--api-key.*rollout.engines.api_key_env"):
        RolloutConfig(engines=EnginesConfig(**beyond_loopback))
    with pytest.raises(ValueError, match="rollout.engines.api_key_env must name an environment"):
        EnginesConfig(api_key_env="not a name")
    cfg = RolloutConfig(engines=EnginesConfig(**beyond_loopback, api_key_env="MGRPO_K"))
    monkeypatch.delenv("MGRPO_K", raising=False)
    with pytest.raises(ValueError, match="MGRPO_K, which is not set"):
        client_config(cfg, ("http://127.0.0.1:1",))
    monkeypatch.setenv("MGRPO_K", KEY)
    client = client_config(cfg, ("http://127.0.0.1:1",))
    assert client.api_key == KEY and client.headers == {"Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(client)
    saved = dump_config(cfg)  # what the run's config.yaml holds of it
    assert "api_key_env: MGRPO_K" in saved and KEY not in saved


def test_launched_sglang_servers_get_the_key_and_their_logs_do_not(tmp_path):
    from megatron_grpo.rollout.servers import LaunchConfig, redacted, server_argv

    cfg = LaunchConfig(
        command="python -m sglang.launch_server --port {port}", log_dir=str(tmp_path), api_key=KEY
    )
    argv = server_argv(cfg, 0, 30000)
    assert argv[-2:] == ["--api-key", KEY] and KEY not in repr(cfg)
    assert KEY not in " ".join(redacted(argv, KEY)) and "***" in redacted(argv, KEY)
    own = LaunchConfig(command=f"serve --port {{port}} --api-key={KEY}", log_dir=str(tmp_path))
    assert server_argv(own, 0, 1).count(f"--api-key={KEY}") == 1


def test_trainer_launched_embedded_server_process_wants_the_key(tmp_path, monkeypatch):
    """End to end: rollout.engines.api_key_env -> an embedded server process on 0.0.0.0 that got
    the variable's name (not the key) on its command line -> the runtime's client."""
    from megatron_grpo.config.hf import model_config_from_hf
    from megatron_grpo.rollout import engines
    from megatron_grpo.rollout.runtime import client_config
    from megatron_grpo.testing import tiny_hf_config

    monkeypatch.setenv("MGRPO_TEST_ROLLOUT_KEY", KEY)
    cfg = RolloutConfig(
        engines=EnginesConfig(
            embedded_server="process",
            host="0.0.0.0",
            api_key_env="MGRPO_TEST_ROLLOUT_KEY",
            log_dir=str(tmp_path / "logs"),
            startup_timeout_s=120.0,
        ),
        prompts_per_step=1,
        samples_per_prompt=1,
    )
    group, model_dir = engines.launch_embedded(
        cfg, model_config_from_hf(tiny_hf_config("qwen2")), seed=0
    )
    try:
        (url,) = group.urls
        argv = Path(f"/proc/{group.processes[0].process.pid}/cmdline").read_bytes()
        assert b"MGRPO_TEST_ROLLOUT_KEY" in argv and KEY.encode() not in argv
        assert call(url, "/server_info", method="GET")[0] == 401

        async def rollout():
            async with SGLangClient(client_config(cfg, group.urls)) as client:
                await client.begin_weight_update()
                await client.end_weight_update()
                return await client.generate(RolloutRequest(prompts=((1, 2),), sampling=GREEDY))

        assert len(asyncio.run(rollout())) == 1
    finally:
        group.stop()
        shutil.rmtree(model_dir, ignore_errors=True)
