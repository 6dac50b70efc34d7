"""``rollout.sync.delta``: after the first push, a stage's sender sends the embedded engine
``zstd(new XOR previous)`` per changed tensor; the engine ends bitwise where a full push
leaves it, a corrupted delta is caught by its checksum and pushed in full, a restarted
engine gets full tensors, and unchanged tensors are not sent; engines that answer as SGLang
are refused at start."""

from __future__ import annotations

import asyncio
import functools
import logging

import pytest
import torch
import zstandard

from megatron_grpo.config import RolloutConfig, WeightSyncConfig
from megatron_grpo.config.hf import model_config_from_hf
from megatron_grpo.embedded import delta as wire
from megatron_grpo.embedded import weight_routes
from megatron_grpo.embedded.weights import copy_into_model, hf_weights
from megatron_grpo.mcore import device
from megatron_grpo.rollout.runtime import RolloutRuntime, client_config
from megatron_grpo.testing import random_hf_model, tiny_hf_config
from megatron_grpo.weight_sync.engines import begin_push, finish_push, refuse_delta_to_sglang
from megatron_grpo.weight_sync.sender import StageSender

HF_CONFIG = tiny_hf_config("qwen2")


class Pusher:
    """One engine and one long-lived sender (its delta state lasts across pushes)."""

    def __init__(self, *, delta: bool) -> None:
        cfg = RolloutConfig(sync=WeightSyncConfig(delta=delta))
        served = random_hf_model(HF_CONFIG, seed=0)
        self.runtime = RolloutRuntime(
            cfg, hf_model=served, model_cfg=model_config_from_hf(HF_CONFIG)
        )
        self.sender = StageSender(
            functools.partial(client_config, self.runtime.cfg),
            0,
            backend=device.distributed_backend(),
        )

    def push(self, named: dict[str, torch.Tensor], version: str):
        plan = begin_push(self.runtime, version)
        report = self.sender.send(iter([dict(named)]), plan)
        assert report.error is None, report.error
        assert finish_push(self.runtime, plan, [report])
        return report

    @property
    def engine(self):
        assert self.runtime.server is not None
        return self.runtime.server.engine

    def close(self) -> None:
        self.sender.close()
        self.runtime.close()


def steps(dtype: torch.dtype, num_steps: int):
    """Weights after each of ``num_steps`` small optimizer-like updates (one norm frozen)."""
    weights = {
        k: v.detach().clone() for k, v in random_hf_model(HF_CONFIG, seed=1).state_dict().items()
    }
    gen = torch.Generator().manual_seed(2)
    for _ in range(num_steps):
        for name, w in weights.items():
            if name != "model.norm.weight":
                w += 1e-3 * torch.randn(w.shape, generator=gen) * w.abs().mean()
        yield {k: v.to(dtype) for k, v in weights.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_and_full_pushes_leave_the_same_weights(dtype):
    full, delta = Pusher(delta=False), Pusher(delta=True)
    try:
        for step, named in enumerate(steps(dtype, 5), start=1):
            full.push(named, str(step))
            report = delta.push(named, str(step))
            assert delta.engine.weight_version == full.engine.weight_version == str(step)
            if step > 1:  # deltas, after the first push
                assert 0 < report.sent_bytes < report.nbytes
            else:
                assert report.sent_bytes == report.nbytes
            ours, theirs = hf_weights(delta.engine.model), hf_weights(full.engine.model)
            for name, sent in named.items():
                assert torch.equal(ours[name], theirs[name]), (step, name)
                assert torch.equal(ours[name].to(dtype), sent), (step, name)
    finally:
        full.close()
        delta.close()


def test_a_corrupted_delta_is_caught_and_pushed_in_full(monkeypatch, caplog):
    target = "model.layers.0.mlp.up_proj.weight"
    add = wire.DeltaBucket.add

    def corrupting_add(self, name, dtype, shape, checksum, frame):
        if name == target:
            xor = bytearray(zstandard.ZstdDecompressor().decompress(frame))
            xor[7] ^= 0x10
            frame = zstandard.ZstdCompressor().compress(bytes(xor))
        add(self, name, dtype, shape, checksum, frame)

    pusher = Pusher(delta=True)
    try:
        pushes = steps(torch.float32, 2)
        pusher.push(next(pushes), "1")
        monkeypatch.setattr(wire.DeltaBucket, "add", corrupting_add)
        named = next(pushes)
        with caplog.at_level(logging.WARNING):
            pusher.push(named, "2")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and target in warnings[0] and "pushed in full" in warnings[0]
        served = hf_weights(pusher.engine.model)
        assert all(torch.equal(served[k], v) for k, v in named.items())
        assert pusher.engine.weight_version == "2"
    finally:
        pusher.close()


def test_a_restarted_engine_gets_full_tensors():
    pusher = Pusher(delta=True)
    try:
        pushes = steps(torch.bfloat16, 3)
        pusher.push(next(pushes), "1")
        second = pusher.push(next(pushes), "2")
        assert second.sent_bytes < second.nbytes
        # a restart: fresh weights, the version it starts at
        copy_into_model(
            pusher.engine.model, random_hf_model(HF_CONFIG, seed=5).state_dict(), require_all=False
        )
        pusher.engine._weight_version = "default"
        named = next(pushes)
        report = pusher.push(named, "3")
        assert report.sent_bytes == report.nbytes
        served = hf_weights(pusher.engine.model)
        assert all(torch.equal(served[k].to(torch.bfloat16), v) for k, v in named.items())
    finally:
        pusher.close()


def test_unchanged_tensors_are_not_sent(monkeypatch):
    headers = []
    parse = weight_routes.parse_body

    def recording_parse(blob):
        header, frames = parse(blob)
        headers.append(header)
        return header, frames

    monkeypatch.setattr(weight_routes, "parse_body", recording_parse)
    pusher = Pusher(delta=True)
    try:
        named = next(steps(torch.float32, 1))
        pusher.push(named, "1")
        assert headers == []  # the first push is a full one
        moved = dict(named)
        moved["model.norm.weight"] = named["model.norm.weight"] + 0.5
        report = pusher.push(moved, "2")
        (header,) = headers
        assert [t["name"] for t in header["tensors"]] == ["model.norm.weight"]
        assert sorted(header["unchanged"]) == sorted(set(named) - {"model.norm.weight"})
        assert report.sent_bytes < report.nbytes / 100  # one small frame and the names
        assert torch.equal(
            hf_weights(pusher.engine.model)["model.norm.weight"], moved["model.norm.weight"]
        )
    finally:
        pusher.close()


def test_delta_needs_the_tensor_method():
    with pytest.raises(ValueError, match="rollout.sync.delta needs rollout.sync.method: tensor"):
        WeightSyncConfig(method="disk", delta=True)


def test_delta_to_an_sglang_engine_is_refused_at_start():
    """An engine that answers ``/server_info`` as SGLang stops the trainer's start (its
    rollout side calls this once its engines are up), before any rollout or push, with the
    message a user reads."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megatron_grpo.config import EnginesConfig
    from megatron_grpo.sglang_api.compat import SGLANG

    class SGLangStandIn(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            info = {"version": SGLANG.tested, "tp_size": 1, "device": "cuda"}
            raw = json.dumps(info if self.path == "/server_info" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = RolloutConfig(
        engines=EnginesConfig(type="sglang", urls=[url]), sync=WeightSyncConfig(delta=True)
    )
    runtime = RolloutRuntime(cfg)
    try:
        with pytest.raises(ValueError) as refused:
            refuse_delta_to_sglang(runtime)
        assert str(refused.value) == (
            f"rollout.sync.delta: {url} is an SGLang engine, and SGLang's API has no endpoint "
            "that applies a delta; turn rollout.sync.delta off (full pushes)"
        )
    finally:
        runtime.close()
        server.shutdown()


def test_an_engine_that_comes_back_as_sglang_is_refused_at_the_push(monkeypatch):
    from megatron_grpo.weight_sync import tensor
    from megatron_grpo.weight_sync.delta import DeltaState
    from megatron_grpo.weight_sync.plan import SyncPlan
    from megatron_grpo.weight_sync.server_kinds import ServerKind

    async def sglang_kinds(client):
        return {"http://sglang:30000": ServerKind(embedded=False, tp_size=1, host=None)}

    monkeypatch.setattr(tensor, "server_kinds", sglang_kinds)
    plan = SyncPlan(("http://sglang:30000",), "tensor", "1", 1 << 20, delta=True)
    with pytest.raises(ValueError, match="SGLang's API has no endpoint that applies a delta"):
        asyncio.run(tensor.tensor_method(None, plan, DeltaState()))
