"""``rollout.sync.check``: an engine that loads a push wrongly is named, with the weight; by
first rows (``true``) or by per-tensor checksums (``checksum``), which catch one byte."""

from __future__ import annotations

import asyncio
import functools

import aiohttp
import pytest
import torch
import xxhash
from engine_push import push_weights

from megatron_grpo.config import RolloutConfig, WeightSyncConfig
from megatron_grpo.config.hf import model_config_from_hf
from megatron_grpo.config.loader import from_dict
from megatron_grpo.embedded import server as embedded_server
from megatron_grpo.embedded.checksum import tensor_checksum
from megatron_grpo.embedded.weights import copy_into_model, hf_weights
from megatron_grpo.rollout.runtime import RolloutRuntime
from megatron_grpo.testing import random_hf_model, tiny_hf_config
from megatron_grpo.weight_sync.check import check_mode, check_ways, compare_sample
from megatron_grpo.weight_sync.server_kinds import ServerKind


def test_compare_sample_allows_bf16_rounding_and_names_real_differences():
    ours = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, 4.0]])
    assert compare_sample("w", ours, ours.to(torch.bfloat16).float()) is None
    assert compare_sample("w", ours, ours[:, :2]) is None  # a TP engine's own columns
    moved = ours.clone()
    moved[1, 2] = 4.5
    assert compare_sample("w", ours, moved) == "w: differs by up to 0.5 (largest value 4)"
    assert "shape (1, 3)" in (compare_sample("w", ours, ours[:1]) or "")


@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_a_weight_the_engine_drops_is_named(monkeypatch, method):
    hf_config = tiny_hf_config("qwen2")
    model_cfg = model_config_from_hf(hf_config)
    served = random_hf_model(hf_config, seed=0)
    pushed = {k: v + 1.0 for k, v in random_hf_model(hf_config, seed=1).state_dict().items()}

    def loses_the_final_norm(model, named_tensors, *, require_all):
        kept = {k: v for k, v in named_tensors.items() if k != "model.norm.weight"}
        copy_into_model(model, kept, require_all=False)

    cfg = RolloutConfig(sync=WeightSyncConfig(method=method, check=True))  # type: ignore[arg-type]
    runtime = RolloutRuntime(cfg, hf_model=served, model_cfg=model_cfg)
    try:
        push_weights(runtime, pushed, weight_version="1")  # a faithful engine passes
        monkeypatch.setattr(embedded_server, "copy_into_model", loses_the_final_norm)
        pushed = {k: v + 1.0 for k, v in pushed.items()}
        with pytest.raises(RuntimeError, match=r"(?s)version 2.*: model\.norm\.weight: differs"):
            push_weights(runtime, pushed, weight_version="2")
    finally:
        runtime.close()


# ---- per-tensor checksums ----


def test_the_checksum_is_xxh3_64_of_the_bytes_in_their_dtype():
    # 1.0 and 2.0 as little-endian float32: 00 00 80 3f, 00 00 00 40
    by_hand = xxhash.xxh3_64_hexdigest(bytes.fromhex("0000803f00000040"))
    assert tensor_checksum(torch.tensor([1.0, 2.0])) == by_hand == "4de8d78f7134f4b7"
    # 1.0 and 2.0 as bfloat16: 80 3f, 00 40
    bf16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert tensor_checksum(bf16) == xxhash.xxh3_64_hexdigest(bytes.fromhex("803f0040"))
    w = torch.arange(12.0).reshape(3, 4)
    assert tensor_checksum(w.t()) == tensor_checksum(w.t().contiguous())  # C order
    assert tensor_checksum(w.t()) != tensor_checksum(w)
    flipped = w.clone()
    flipped.view(torch.uint8)[0, 0] ^= 1  # the lowest byte of w[0, 0]
    assert tensor_checksum(flipped) != tensor_checksum(w)


def test_check_settings_and_which_engines_answer_checksums():
    def setting(value):
        return from_dict(WeightSyncConfig, {"check": value}, prefix="rollout.sync.").check

    assert [check_mode(setting(v)) for v in (False, True, "rows", "checksum")] == [
        None,
        "rows",
        "rows",
        "checksum",
    ]
    assert check_mode(WeightSyncConfig().check) is None  # off unless asked
    with pytest.raises(ValueError, match="not one of 'rows', 'checksum'"):
        setting("sha256")
    embedded = ServerKind(embedded=True, tp_size=1, host=None)
    sglang = ServerKind(embedded=False, tp_size=2, host=None)
    kinds = {"http://a": embedded, "http://b": sglang}
    assert check_ways("checksum", kinds) == {"http://a": "checksum", "http://b": "rows"}
    assert check_ways("rows", kinds) == {"http://a": "rows", "http://b": "rows"}


def _flip_one_byte(runtime, name: str) -> None:
    """Flip one bit of weight ``name`` in the in-process engine's model (fp32): the lowest
    mantissa bit a bf16 keeps, of an element past the rows that ``rows`` reads back."""
    held = hf_weights(runtime.server.engine.model)[name]
    element = 10 * held.shape[-1] + 3
    with torch.no_grad():
        held.view(-1).view(torch.uint8)[4 * element + 2] ^= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checksummed_push_passes_and_one_flipped_byte_is_named(dtype):
    """A push checked by checksums passes (bf16 too: the fp32 engine holds it exactly); one
    byte flipped in one weight on the engine after the push is named, with the engine. The
    first-rows check misses it."""
    hf_config = tiny_hf_config("qwen2")
    model_cfg = model_config_from_hf(hf_config)
    served = random_hf_model(hf_config, seed=0)
    pushed = {k: v.to(dtype) for k, v in random_hf_model(hf_config, seed=1).state_dict().items()}
    target = "model.layers.1.mlp.down_proj.weight"

    def runtime_checking(check):
        cfg = RolloutConfig(sync=WeightSyncConfig(check=check))
        return RolloutRuntime(cfg, hf_model=served, model_cfg=model_cfg)

    runtime = runtime_checking("checksum")
    try:
        push_weights(runtime, pushed, weight_version="1")  # a faithful engine passes
        flip = functools.partial(_flip_one_byte, runtime, target)
        url = runtime.server.url
        with pytest.raises(RuntimeError) as raised:
            push_weights(runtime, pushed, weight_version="2", before_check=flip)
        first = str(raised.value).splitlines()[1].strip()
        assert first.startswith(f"{url}: {target}: checksum ")
        assert "version 2" in str(raised.value) and str(raised.value).count(": checksum ") == 1
    finally:
        runtime.close()
    runtime = runtime_checking(True)
    try:
        flip = functools.partial(_flip_one_byte, runtime, target)
        push_weights(runtime, pushed, weight_version="3", before_check=flip)  # rows miss it
    finally:
        runtime.close()


def test_the_checksum_endpoint_names_what_it_cannot_answer():
    hf_config = tiny_hf_config("qwen2")
    model = random_hf_model(hf_config, seed=0)
    server = embedded_server.start_embedded_server(model, seed=0)
    name = "model.norm.weight"

    async def ask(body):
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/weights_checksum", json=body) as reply:
                return reply.status, await reply.json()

    try:
        status, answer = asyncio.run(ask({"names": [name], "dtypes": ["bfloat16"]}))
        held = hf_weights(model)[name]
        assert status == 200 and answer["algorithm"] == "xxh3_64"
        assert answer["checksums"] == [tensor_checksum(held.detach().to(torch.bfloat16))]
        assert asyncio.run(ask({"names": ["nope"], "dtypes": ["float32"]})) == (
            400,
            {"error": "no weight named 'nope'"},
        )
        status, answer = asyncio.run(ask({"names": [name], "dtypes": ["nn"]}))
        assert status == 400 and "no dtype 'nn'" in answer["error"]
        status, answer = asyncio.run(ask({"names": [name], "dtypes": []}))
        assert status == 400 and "1 names but 0 dtypes" in answer["error"]
    finally:
        server.stop()
