"""The ``sglang`` part of ``gpu_bench.py``: generation tokens/s and weight sync with SGLang.

A random Qwen3-shaped model saved with transformers, ``python -m
sglang.launch_server`` on it, generation through the trainer's
``SGLangClient``, then the weights of a megatron learner holding the same model
pushed to the server as the trainer pushes them (``weight_sync.push.WeightPush``).

Each figure has a reference measured in the same run, interleaved with it:
- generation: the same prompts and sampling as ONE batched ``/generate`` request sent
  straight to the server (SGLang's own throughput, without the trainer's client): the
  ratio client / direct says what the client costs;
- weight push: every HF tensor of the model in ONE ``/update_weights_from_tensor`` request
  (CUDA IPC on a GPU), made from tensors already gathered and named: the ratio push / one
  request says what the trainer's streaming (a layer at a time, bucketed) costs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def sglang_model(tiny: bool):
    """The served model's HF config, through the project's own ModelConfig -> HF mapping."""
    from megatron_grpo.config import ModelConfig
    from megatron_grpo.convert.hf_config import hf_config_from_model_config

    if tiny:
        from _common import tiny_model

        cfg = tiny_model(
            vocab_size=512, max_position_embeddings=1024, qk_layernorm=True, tie_embeddings=True
        )
    else:  # Qwen3-0.6B's shape
        cfg = ModelConfig(
            num_layers=28,
            hidden_size=1024,
            ffn_hidden_size=3072,
            num_attention_heads=16,
            num_query_groups=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=4096,
            rotary_base=1000000.0,
            qk_layernorm=True,
            tie_embeddings=True,
        )
    return hf_config_from_model_config(cfg, "qwen3")


def sglang_importable(python: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            [python, "-c", "import sglang.launch_server"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, str(err)
    return done.returncode == 0, done.stderr[-2000:]


def part_sglang(args, *, startup_timeout_s: float) -> dict[str, Any]:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_grpo.rollout.servers import LaunchConfig, launch_servers

    python = os.environ.get("SGLANG_PYTHON", sys.executable)
    ok, why = sglang_importable(python)
    if not ok:
        return {"sglang": "sglang not installed", "python": python, "import_error": why}
    work = Path(tempfile.mkdtemp(prefix="mgrpo_gpu_bench_"))
    try:
        hf_dir = work / "model"
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(sglang_model(args.tiny))
        model.to(torch.float32 if args.tiny else torch.bfloat16).save_pretrained(hf_dir)
        del model
        command = (
            f"{python} -m sglang.launch_server --model-path {{model}} --host {{host}} "
            f"--port {{port}} --skip-tokenizer-init {args.sglang_args}"
        )
        t0 = time.perf_counter()
        group = launch_servers(
            LaunchConfig(
                command=command,
                model=str(hf_dir),
                log_dir=str(work / "logs"),
                startup_timeout_s=startup_timeout_s,
            )
        )
        try:
            result: dict[str, Any] = {"server_start_s": time.perf_counter() - t0}
            learner = _learner(hf_dir)
            # One client per phase: between phases this process does other work, and a
            # pooled keep-alive connection the server closed meanwhile would fail a call.
            result["generation"] = asyncio.run(_generate(group.urls, args))
            result["weight_sync"] = _sync(group.urls, learner)
        finally:
            group.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _learner(hf_dir: Path):
    """A megatron model (world size 1) holding the served checkpoint."""
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims())
    cfg = resolve_hf_model(hf_dir)
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    return model, ctx, cfg


def _client(urls):
    from megatron_grpo.rollout.client import ClientConfig, SGLangClient

    return SGLangClient(ClientConfig(urls=tuple(urls), max_concurrency=512))


def _prompts(num_prompts: int) -> tuple[tuple[int, ...], ...]:
    import torch

    g = torch.Generator().manual_seed(0)
    return tuple(
        tuple(
            torch.randint(
                1, 500, (int(torch.randint(64, 193, (1,), generator=g)),), generator=g
            ).tolist()
        )
        for _ in range(num_prompts)
    )


async def _generate(urls, args) -> dict[str, Any]:
    """tokens/s through the trainer's client and in one direct batched request, interleaved
    (each side's first run is a warm-up)."""
    from _common import Ratio

    from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams

    num_prompts, n = (2, 2) if args.tiny else (64, 8)
    new_tokens = 8 if args.tiny else 512
    prompts = _prompts(num_prompts)
    runs: list[float] = []
    direct: list[float] = []
    async with _client(urls) as client:
        for rep in range(3):
            request = RolloutRequest(
                prompts=prompts,
                num_samples=n,
                sampling=SamplingParams(
                    max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=rep
                ),
            )
            t0 = time.perf_counter()
            samples = await client.generate(request)
            elapsed = time.perf_counter() - t0
            tokens, seconds = await asyncio.to_thread(
                _direct_batch, urls[0], prompts, n, new_tokens
            )
            if rep:
                runs.append(sum(len(s.output_ids) for s in samples) / elapsed)
                direct.append(tokens / seconds)
    return {
        "prompts": num_prompts,
        "n": n,
        "new_tokens": new_tokens,
        "tokens_per_s": runs,
        "direct_tokens_per_s": direct,
        "client/direct": Ratio.of(
            "client/direct [tokens/s]", [a / b for a, b in zip(runs, direct)]
        ),
    }


def _direct_batch(url: str, prompts, n: int, new_tokens: int) -> tuple[int, float]:
    """One ``/generate`` of every prompt n times, straight to the server: (tokens, seconds)."""
    import json
    import urllib.request

    body = {
        "input_ids": [list(p) for p in prompts for _ in range(n)],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    request = urllib.request.Request(
        url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answers = json.loads(response.read())
    seconds = time.perf_counter() - t0
    return sum(int(a["meta_info"]["completion_tokens"]) for a in answers), seconds


def _sync(urls, learner) -> dict[str, Any]:
    """Three pushes as the trainer makes them (``WeightPush``, ``rollout.sync.method=tensor``),
    each followed by the one-request reference push of the same weights."""
    import torch
    from _common import Ratio

    from megatron_grpo.config import EnginesConfig, RolloutConfig
    from megatron_grpo.mcore.hf_export import stage_hf_layers
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.sglang_api.types import RolloutRequest, SamplingParams
    from megatron_grpo.weight_sync.push import WeightPush

    model, ctx, cfg = learner
    rollout = RolloutConfig(engines=EnginesConfig(type="sglang", urls=list(urls)))
    runtime = RolloutRuntime(rollout, model_cfg=cfg)
    push = WeightPush(cfg, rollout, ctx)
    named = {k: t for u in stage_hf_layers(model, cfg, ctx) for k, t in u.items()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    pushes, one_request = [], []
    try:
        for version in range(1, 4):
            t0 = time.perf_counter()
            push(model, str(version), runtime)
            _synchronize()
            pushes.append({"push_s": time.perf_counter() - t0, "bytes": nbytes})
            one_request.append(asyncio.run(_one_request_push(urls[0], named, f"{version}-ref")))
        request = RolloutRequest(
            prompts=_prompts(1),
            sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
        )
        check = runtime.io.run(runtime.client.generate(request))
    finally:
        push.close()
        runtime.close()
    way = "CUDA IPC" if torch.cuda.is_available() else "shared memory"
    return {
        "method": f"tensor (SGLang's format, {way}), streamed a layer at a time in buckets",
        "runs": pushes,
        "gb_per_s": [p["bytes"] / p["push_s"] / 1e9 for p in pushes],
        "one_request_s": one_request,
        "push/one_request": Ratio.of(
            "push/one_request [s]", [p["push_s"] / r for p, r in zip(pushes, one_request)]
        ),
        "weight_version_after": check[0].weight_version,
        "distributed": "not measured: on one GPU NCCL refuses the server and the learner as "
        "two ranks of one device (tests/gpu/test_gpu_sglang.py records the error)",
    }


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def _one_request_push(url: str, named, version: str) -> float:
    """Seconds to hand SGLang every tensor of ``named`` in one request, copies included, inside
    the same pause / begin / end / continue as a push."""
    import torch

    from megatron_grpo.weight_sync.sglang_tensor import (
        cuda_copies,
        sglang_tensor_payload,
        shared_copies,
    )

    async with _client([url]) as client:
        t0 = time.perf_counter()
        await client.pause_generation()
        await client.flush_cache()
        await client.begin_weight_update()
        copies = cuda_copies(named) if torch.cuda.is_available() else shared_copies(named)
        payload = sglang_tensor_payload(copies, tp_size=1, weight_version=version)
        await client.update_weights_from_tensor(payload, url=url)
        await client.end_weight_update()
        await client.continue_generation()
        _synchronize()
        return time.perf_counter() - t0
