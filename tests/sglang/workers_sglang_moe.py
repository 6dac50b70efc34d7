"""The learner's side of the real-SGLang MoE test: replays a real server's routed experts.

``replay_steps`` runs on one gloo rank (``run_workers``): a Qwen3-MoE megatron policy loaded
from the server's HF checkpoint, with ``train.routing_replay=r3``, takes on-policy
optimizer steps (lr 0) on the server's samples and their routes, as the trainer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

METRICS = ("logprob_mismatch", "logprob_mismatch_max", "router_agreement", "router_agreement_own")


def replay_steps(hf_dir: str, generations: list) -> dict[str, dict[str, Any]]:
    """Two steps' metrics (``METRICS``): ``replayed``, on the server's routes, and
    ``shifted``, on each sample's routes one position late, as a misaligned reading of
    SGLang's answer would give. ``logprob_mismatch``: |learner - server| log-prob of the
    output tokens; ``router_agreement``: the learner's routers' own top-k sets against the
    replayed ones."""
    from megatron_grpo.commands.convert.hf_to_megatron import resolve_hf_model
    from megatron_grpo.config import OptimConfig, ParallelDims, TrainConfig
    from megatron_grpo.convert.hf_files import HFCheckpoint, MegatronView
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims())
    cfg = resolve_hf_model(hf_dir)
    optim = OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0, use_distributed_optimizer=False)
    model = build_model(cfg, ctx, optim=optim, train=TrainConfig(routing_replay="r3"))
    load_full_state(model, MegatronView(HFCheckpoint(hf_dir), cfg), cfg, ctx)
    optimizer, scheduler = build_optimizer(optim, cfg, model, ctx)
    shifted = [
        dataclasses.replace(g, routed_experts=np.roll(g.routed_experts, 1, axis=0))
        for g in generations
    ]
    return {
        name: _step(model, optimizer, scheduler, ctx, cfg.vocab_size, gens)
        for name, gens in (("replayed", generations), ("shifted", shifted))
    }


def _step(model, optimizer, scheduler, ctx, vocab_size: int, generations: list) -> dict[str, Any]:
    from megatron_grpo.algo.batch import make_samples
    from megatron_grpo.config import LossConfig
    from megatron_grpo.rollout.stage import sample_routes
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    tokens = [list(g.prompt_ids) + list(g.output_ids) for g in generations]
    samples = make_samples(
        tokens,
        [[0.0] * len(g.prompt_ids) + [1.0] * len(g.output_ids) for g in generations],
        advantages=[1.0 - 2.0 * (g.sample_index % 2) for g in generations],
        groups=[g.prompt_index for g in generations],
        rollout_logprobs=[
            [0.0] * len(g.prompt_ids) + list(g.rollout_logprobs) for g in generations
        ],
        routes=sample_routes(generations, [len(t) for t in tokens]),
    )
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=256,
        pack=True,
        vocab_size=vocab_size,
        max_len=max(len(g.output_ids) for g in generations),
    )
    (metrics,) = train_on_rollout(model, optimizer, scheduler, ctx, samples, LossConfig(), settings)
    return {k: metrics[k] for k in METRICS}
