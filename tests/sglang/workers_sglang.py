"""The learner's side of the real-SGLang tier: a TP2 x PP2 megatron policy and one server.

``learner_scenario`` runs on 4 gloo ranks (``run_workers``). Global rank 0
is the trainer's main rank: it generates through ``RolloutRuntime`` (attached
to the server) and opens each weight push; every rank takes part in the forward
passes, and both pipeline stages send their own layers (``weight_sync.push``). Phases:

- ``initial``: the HF weights loaded into the learner; the server serves the
  same checkpoint;
- ``disk``, ``tensor``, ``distributed``: the learner's weights are changed
  (seeded noise on every tensor), pushed with that method and weight version
  = step, and the server generates again.

Each phase records the server's greedy samples and, for the same tokens,
the learner's per-token log-probs (``vocab_parallel_logprobs`` on the TP
shards of the last stage) and argmax (from the TP-gathered logits). Rank 0 returns them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

METHODS = ("disk", "tensor", "distributed")


def _learner_forward(model: list, ctx, tokens: list[int], vocab_size: int) -> dict[str, Any]:
    """Per-position logprob of the next token and argmax, from one forward pass."""
    from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
    from megatron_grpo.mcore.schedule import TokenBatch, run_schedule

    ids = torch.tensor([tokens])
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    out: dict[str, Any] = {}

    def keep(batch, logits):
        logp, _ = vocab_parallel_logprobs(
            logits, targets, tp_group=ctx.tp_group, vocab_size=vocab_size
        )
        parts = [torch.empty_like(logits) for _ in range(ctx.dims.tp)]
        dist.all_gather(parts, logits.contiguous(), group=ctx.tp_group)
        full = torch.cat(parts, dim=-1)[..., :vocab_size]
        out["logprobs"] = logp[0]
        out["argmax"] = full[0].argmax(dim=-1)
        return logits.sum() * 0, torch.tensor(1), {}

    with torch.no_grad():
        run_schedule(model, ctx, [TokenBatch.of(ids)], keep, forward_only=True)
    return out  # empty before the last stage


def _phase(runtime, model, ctx, cfg, rollout_cfg, prompts) -> list[dict[str, Any]]:
    """The server's greedy samples (from rank 0, to all) and the learner's view of them."""
    samples = None
    if ctx.is_main:
        groups = runtime.generate_groups(prompts, rollout_cfg, seed=0, stop_token_ids=[])
        samples = [
            {
                "prompt": list(s.prompt_ids),
                "output": list(s.output_ids),
                "server_logprobs": list(s.rollout_logprobs),
                "finish": s.finish_reason.type,
                "weight_version": s.weight_version,
            }
            for g in groups
            for s in g
        ]
    box = [samples]
    dist.broadcast_object_list(box, src=0)
    rows: list[dict[str, Any]] = box[0]  # type: ignore[assignment]  # set on every rank now
    for row in rows:
        start = len(row["prompt"]) - 1  # the position that predicts the first output token
        fwd = _learner_forward(model, ctx, row["prompt"] + row["output"], cfg.vocab_size)
        n = len(row["output"])
        if fwd:
            row["learner_logprobs"] = fwd["logprobs"][start : start + n].tolist()
            row["learner_argmax"] = fwd["argmax"][start : start + n].tolist()
    # The last stage computed them: its rows, on every rank.
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, rows if ctx.is_last_stage and ctx.tp_rank == 0 else None)
    return next(r for r in everyone if r is not None)


def learner_scenario(
    hf_dir: str, url: str, prompts: list[list[int]], max_new_tokens: int, work_dir: str
) -> dict[str, Any] | None:
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import (
        EnginesConfig,
        ParallelDims,
        RolloutConfig,
        SamplingConfig,
        WeightSyncConfig,
    )
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.testing import perturb_weights
    from megatron_grpo.weight_sync.push import WeightPush

    ctx = init_parallel(ParallelDims(tp=2, pp=2))
    cfg = resolve_hf_model(hf_dir)
    model = build_model(cfg, ctx, wrap_ddp=False)
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)

    def rollout_cfg(method: str) -> RolloutConfig:
        return RolloutConfig(
            engines=EnginesConfig(type="sglang", urls=[url]),
            prompts_per_step=len(prompts),
            samples_per_prompt=1,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature=0.0),
            sync=WeightSyncConfig(
                method=method,  # type: ignore[arg-type]
                bucket_mb=1,  # several buckets even for this tiny model
                disk_dir=work_dir,
            ),
        )

    phases: dict[str, Any] = {}
    timings: dict[str, float] = {}
    runtime = RolloutRuntime(rollout_cfg("tensor")) if ctx.is_main else None
    phases["initial"] = _phase(runtime, model, ctx, cfg, rollout_cfg("tensor"), prompts)
    if runtime is not None:
        runtime.close()
    for step, method in enumerate(METHODS, start=1):
        perturb_weights(model, ctx, cfg, seed=step)
        method_cfg = rollout_cfg(method)
        runtime = RolloutRuntime(method_cfg, model_cfg=cfg) if ctx.is_main else None
        push = WeightPush(cfg, method_cfg, ctx)
        start = time.perf_counter()
        push(model, str(step), runtime)  # collective: every stage sends its own layers
        timings[method] = time.perf_counter() - start
        push.close()
        phases[method] = _phase(runtime, model, ctx, cfg, method_cfg, prompts)
        if runtime is not None:
            runtime.close()
    # SGLang reads no Qwen weight back: rollout.sync.check says so by name.
    checked = rollout_cfg("tensor")
    checked.sync.check = True
    runtime = RolloutRuntime(checked, model_cfg=cfg) if ctx.is_main else None
    push = WeightPush(cfg, checked, ctx)
    try:
        push(model, "check", runtime)
        check_error = ""
    except RuntimeError as err:
        check_error = str(err)
    push.close()
    if runtime is not None:
        runtime.close()
    # The trainer's own groups still work after the broadcast group came and went.
    check = torch.ones(1)
    dist.all_reduce(check)
    if not ctx.is_main:
        return None
    world = ctx.world_size
    return {
        "phases": phases,
        "push_s": timings,
        "all_reduce": float(check),
        "world": world,
        "check_error": check_error,
    }
