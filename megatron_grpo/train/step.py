"""Optimizer steps on one rollout batch.

The rollout batch (every sample of one RL step, identical on all ranks) is
cut into global batches of ``global_batch_size`` samples, one optimizer step
each. Before any step, the behaviour policy's log-probs ("old") and the
reference model's are computed once, forward only. Then ``num_iterations``
(mu) passes run over the global batches. The loss denominators of a global
batch are computed once (one DP all-reduce) and reused by every pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_grpo.algo.batch import Sample, collate
from megatron_grpo.algo.loss import METRIC_SUMS, compute_logprobs, grpo_loss, set_loss_weights
from megatron_grpo.config import LossConfig
from megatron_grpo.mcore.device import compute_device
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.schedule import run_schedule, zero_grads
from megatron_grpo.train.plan import plan


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    global_batch_size: int
    """Samples per optimizer step."""
    num_iterations: int
    """mu: optimizer passes over each rollout batch."""
    max_tokens_per_micro_batch: int
    """Token budget of one micro-batch on one rank (padding included)."""
    pack: bool
    """Pack samples end to end in one row per micro-batch."""
    vocab_size: int
    max_len: int
    """Default L for Dr. GRPO: the max completion length."""


def global_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    if len(samples) % size:
        raise ValueError(
            f"the rollout batch has {len(samples)} samples, not a multiple of "
            f"train.global_batch_size={size}"
        )
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def _micro_batches(batch: list[Sample], ctx: ParallelContext, s: StepSettings) -> list[dict]:
    groups = sorted({x.group for x in batch})
    local_group = {g: i for i, g in enumerate(groups)}  # group ids local to this global batch
    renumbered = [
        Sample(
            tokens=x.tokens,
            loss_mask=x.loss_mask,
            advantage=x.advantage,
            group=local_group[x.group],
            sample_id=x.sample_id,
            rollout_logprobs=x.rollout_logprobs,
        )
        for x in batch
    ]
    p = plan(
        [len(x) for x in renumbered],
        dp_size=ctx.dp_size,
        max_tokens=s.max_tokens_per_micro_batch,
        packed=s.pack,
    )
    mbs = [
        collate([[renumbered[i] for i in row] for row in mb]) for mb in p.micro_batches(ctx.dp_rank)
    ]
    dev = compute_device()
    for mb in mbs:
        for key, value in mb.items():
            if isinstance(value, torch.Tensor):
                mb[key] = value.to(dev)
        mb["num_groups"] = len(groups)
    return mbs


def train_on_rollout(
    model: list,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    samples: list[Sample],
    loss_cfg: LossConfig,
    settings: StepSettings,
    *,
    ref_model: list | None = None,
) -> list[dict[str, float]]:
    """All optimizer steps of one rollout batch; metrics per step (same on every rank)."""
    batches = [
        _micro_batches(b, ctx, settings)
        for b in global_batches(samples, settings.global_batch_size)
    ]
    needs_old = settings.num_iterations > 1 or len(batches) > 1
    for mbs in batches:
        if needs_old:  # the policy moves between steps: freeze the behaviour log-probs first
            compute_logprobs(model, ctx, mbs, vocab_size=settings.vocab_size)
        if ref_model is not None:
            compute_logprobs(
                ref_model, ctx, mbs, vocab_size=settings.vocab_size, key="ref_logprobs"
            )
        set_loss_weights(
            mbs, loss_cfg, ctx, num_groups=mbs[0]["num_groups"], max_len=settings.max_len
        )
    loss_fn = functools.partial(
        grpo_loss, cfg=loss_cfg, tp_group=ctx.tp_group, vocab_size=settings.vocab_size
    )
    history = []
    for _ in range(settings.num_iterations):
        for mbs in batches:
            zero_grads(model)
            optimizer.zero_grad()
            per_mb = run_schedule(model, ctx, mbs, loss_fn)
            _, grad_norm, _ = optimizer.step()
            scheduler.step(1)
            metrics = reduce_metrics(per_mb, ctx)
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
            metrics["lr"] = float(optimizer.param_groups[0]["lr"])
            history.append(metrics)
    return history


def reduce_metrics(per_mb: list[dict[str, Any]], ctx: ParallelContext) -> dict[str, float]:
    """Token-mean metrics of one global batch, the same on every rank.

    Only one TP rank of each last-stage DP replica contributes, so nothing is
    counted twice; the sum runs over the whole world so that every rank
    (first stages included) gets the numbers.
    """
    keys = ("loss",) + METRIC_SUMS
    totals = torch.zeros(len(keys), dtype=torch.float64)
    if ctx.is_last_stage and ctx.tp_rank == 0:
        for mb in per_mb:
            totals += torch.tensor([float(mb[k]) for k in keys], dtype=torch.float64)
    if ctx.world_size > 1:
        on_device = totals.to(compute_device())  # nccl reduces GPU tensors only
        dist.all_reduce(on_device)
        totals = on_device.cpu()
    sums = dict(zip(keys, totals.tolist()))
    tokens = max(sums["tokens"], 1.0)
    return {
        "loss": sums["loss"],
        "loss_tokens": sums["tokens"],
        "clip_fraction": sums["clipped"] / tokens,
        "kl": sums["kl"] / tokens,
        "entropy": sums["entropy"] / tokens,
        "logprob_mismatch": sums["mismatch"] / tokens,
        "is_rejected_fraction": sums["is_rejected"] / tokens,
    }
