"""The learner's offload on a GPU: the device memory drops by what was offloaded and comes
back, and the host copies are pinned.

One process, bf16 parameters with the distributed optimizer (DP1): after one optimizer step
(Adam's moments exist), ``torch.cuda.memory_allocated`` must fall by the optimizer's fp32
master shards and moments plus DDP's fp32 gradient buffer when those two parts leave, by the
bf16 parameter buffer when the parameters leave, and return to where it was on reload. The
caching allocator rounds each block up to 512 bytes: SLACK per storage.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from gpu_tier import record

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HERE = Path(__file__)
SLACK = 512


def offload_on_gpu() -> dict[str, Any]:
    import time

    import torch

    from megatron_grpo.commands.invariance.cases import (
        MAX_COMPLETION,
        default_loss,
        default_model,
        fixed_batch,
    )
    from megatron_grpo.config import OptimConfig, ParallelDims
    from megatron_grpo.mcore.model import build_model, sync_params
    from megatron_grpo.mcore.offload import LearnerOffload
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    ctx = init_parallel(ParallelDims())
    cfg = dataclasses.replace(
        default_model(), num_layers=4, hidden_size=512, ffn_hidden_size=1536,
        num_attention_heads=8, num_query_groups=4, vocab_size=32000, params_dtype="bfloat16",
    )  # fmt: skip
    optim = OptimConfig(lr=1e-4, use_distributed_optimizer=True)
    model = build_model(cfg, ctx, optim=optim)
    optimizer, scheduler = build_optimizer(optim, cfg, model, ctx)
    samples = fixed_batch(cfg.vocab_size)
    settings = StepSettings(
        global_batch_size=len(samples), num_iterations=1, max_tokens_per_micro_batch=256,
        pack=False, vocab_size=cfg.vocab_size, max_len=MAX_COMPLETION,
    )  # fmt: skip
    offload = LearnerOffload(model, optimizer, ["optimizer", "grads", "params"])
    predicted = offload.host_bytes()
    loss = dataclasses.replace(default_loss("token-mean"), kl_coef=0.0)  # no reference model
    train_on_rollout(model, optimizer, scheduler, ctx, samples, loss, settings)
    sync_params(model)
    torch.cuda.synchronize()

    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model[0].buffers)
    at = {"trained": torch.cuda.memory_allocated()}
    seconds = {}
    start = time.perf_counter()
    offload.offload(["optimizer", "grads"])
    seconds["optimizer_and_grads"] = time.perf_counter() - start
    at["optimizer_and_grads_offloaded"] = torch.cuda.memory_allocated()
    start = time.perf_counter()
    offload.offload(["params"])
    seconds["params"] = time.perf_counter() - start
    at["params_offloaded"] = torch.cuda.memory_allocated()
    start = time.perf_counter()
    offload.reload()
    seconds["reload"] = time.perf_counter() - start
    at["reloaded"] = torch.cuda.memory_allocated()
    host = {part: [h for h in copies] for part, copies in offload._host.items()}
    return {
        "allocated": at,
        "seconds": seconds,
        "grad_bytes": grads,
        "host_bytes": {part: sum(h.numel() for h in copies) for part, copies in host.items()},
        "storages": {part: len(copies) for part, copies in host.items()},
        "pinned": all(h.is_pinned() for copies in host.values() for h in copies),
        "predicted_host_bytes": predicted,
    }


def test_device_memory_drops_by_the_offloaded_bytes_and_comes_back():
    [r] = run_workers(f"{HERE}:offload_on_gpu", 1, timeout=300)
    record("offload", r)
    print(r)
    at, host, storages = r["allocated"], r["host_bytes"], r["storages"]
    assert r["pinned"]
    assert r["predicted_host_bytes"] == host["optimizer"] + host["params"]
    first = at["trained"] - at["optimizer_and_grads_offloaded"]
    expected = host["optimizer"] + r["grad_bytes"]
    assert expected <= first <= expected + SLACK * (storages["optimizer"] + 1), (first, expected)
    second = at["optimizer_and_grads_offloaded"] - at["params_offloaded"]
    assert host["params"] <= second <= host["params"] + SLACK * storages["params"], second
    assert at["reloaded"] == at["trained"]
