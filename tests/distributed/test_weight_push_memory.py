"""A weight push never stages the whole model: each rank's resident memory stays in its bound.

A TP2 x PP2 learner (4 gloo processes) pushes a 12-layer fp32 model of ~105 MB with the
trainer's ``WeightPush`` (``tensor`` method, 2 MiB buckets) to an embedded server in a
process of its own. A thread samples every rank's resident set each millisecond (glibc is
told to return freed memory at once). Each rank's growth over its resident set before the
push must stay within ``memory_model.weight_push_bytes`` (two decoder layers and two
buckets, 25.5 MiB here) plus a fixed allowance of 16 MiB; a stage's weights (~50 MiB)
or the full model would not fit. Seen: the two senders grew 24.3 MiB, the other ranks 0.1.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_grpo.launch import free_port, run_workers
from megatron_grpo.rollout.servers import http_ok
from megatron_grpo.testing import random_hf_model, tiny_hf_config
from megatron_grpo.testing.memory import MALLOC_ENV, ResidentPeak

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

HERE = Path(__file__)
BUCKET_MB = 2
ALLOWANCE = 16 << 20
"""Python objects, the HTTP client's buffers and the sampler: a fixed few MB."""


def push_and_measure(hf_dir: str, url: str) -> dict[str, Any]:
    import ctypes
    import gc

    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.commands.memory_model import weight_push_bytes
    from megatron_grpo.config import EnginesConfig, ParallelDims, RolloutConfig, WeightSyncConfig
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.weight_sync.push import WeightPush

    ctx = init_parallel(ParallelDims(tp=2, pp=2))
    cfg = resolve_hf_model(hf_dir)
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    rollout = RolloutConfig(
        engines=EnginesConfig(type="sglang", urls=[url]), sync=WeightSyncConfig(bucket_mb=BUCKET_MB)
    )
    runtime = RolloutRuntime(rollout, model_cfg=cfg) if ctx.is_main else None
    push = WeightPush(cfg, rollout, ctx)
    push(model, "0", runtime)  # clients and groups opened, imports done
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak = ResidentPeak()
    push(model, "1", runtime)
    growth = peak.growth()
    push.close()
    if runtime is not None:
        runtime.close()
    full = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    return {
        "growth": growth,
        "bound": weight_push_bytes(cfg, BUCKET_MB << 20),
        "shard": full,
        "tp_rank": ctx.tp_rank,
    }


@pytest.fixture
def embedded_server_process(tmp_path):
    shape = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 12}
    heads = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64}
    hf = random_hf_model(tiny_hf_config("qwen3", **shape, **heads))
    hf.save_pretrained(tmp_path / "hf")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "megatron_grpo.embedded"]
        + ["--model-path", str(tmp_path / "hf"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if http_ok(f"{url}/health", timeout_s=1.0):
                break
            assert server.poll() is None, "the embedded server exited"
            time.sleep(0.1)
        yield str(tmp_path / "hf"), url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_no_rank_grows_past_the_stated_bound_during_a_push(embedded_server_process):
    hf_dir, url = embedded_server_process
    results = run_workers(
        f"{HERE}:push_and_measure", 4, kwargs={"hf_dir": hf_dir, "url": url}, env=MALLOC_ENV
    )
    bound = results[0]["bound"]
    stage_weights = 2 * results[0]["shard"]  # a stage's TP2 shards together
    assert bound + ALLOWANCE < stage_weights, "the model is too small to tell the bound apart"
    for rank, r in enumerate(results):
        print(f"rank {rank}: grew {r['growth'] / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB)")
        assert r["growth"] <= bound + ALLOWANCE, (rank, r["growth"], bound)
