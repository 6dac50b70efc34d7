"""Optimizer steps on one rollout batch: the step function of the project.

The trainer, ``check-invariance`` and the benchmarks all run these functions,
so a check vouches for the code that trains.

The rollout batch (every sample of one RL step, identical on all ranks) is
cut into global batches of ``global_batch_size`` samples, one optimizer step
each. Each global batch is planned into this rank's micro-batches
(``plan_micro_batches``: the DP split and token budget of ``train.plan``).
Before any step, the behaviour policy's log-probs ("old") and the reference
model's are computed once, forward only, and the loss weights w_i of each
global batch are set from its global counts (one DP all-reduce), reused by
every pass. Then ``num_iterations`` (mu) passes run over the global batches,
one ``optimizer_step`` each.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_grpo.algo.batch import (
    MicroBatch,
    Sample,
    collate,
    collate_thd,
    context_parallel_shard,
)
from megatron_grpo.algo.logprobs import vocab_parallel_logprobs
from megatron_grpo.algo.loss import METRIC_MAXES, METRIC_SUMS, grpo_loss, set_loss_weights
from megatron_grpo.config import LossConfig
from megatron_grpo.mcore.device import compute_device
from megatron_grpo.mcore.layers import have_transformer_engine
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.mcore.router_balance import router_balance
from megatron_grpo.mcore.routing_replay import routing_replay
from megatron_grpo.mcore.schedule import LossFn, run_schedule, zero_grads
from megatron_grpo.train.plan import plan, split_to_count, split_to_multiple


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


def uses_thd(settings: StepSettings, ctx: ParallelContext) -> bool:
    """Whether micro-batches take Transformer Engine's packed THD format: always with context
    parallelism; for packed rows when Transformer Engine's attention runs, since its causal
    attention ignores the dense block-diagonal mask that the local spec's attention applies."""
    return ctx.dims.cp > 1 or (settings.pack and have_transformer_engine())


def plan_micro_batches(
    batch: list[Sample], ctx: ParallelContext, settings: StepSettings
) -> list[MicroBatch]:
    """This rank's micro-batches of one global batch, on the compute device.

    Group ids are renumbered to be local to the global batch, whose groups are
    what the loss modes count. With a virtual pipeline the count is made a multiple
    of PP and every micro-batch padded to one shape (megatron-core's interleaved
    schedule pairs activations and their gradients by shape); with sequence
    parallelism rows are padded to a multiple of TP. In THD format (``uses_thd``) each
    micro-batch is one row of whole samples, each padded to a multiple of 2 CP (times TP
    under sequence parallelism), and under context parallelism this CP rank's share of it.
    """
    groups = sorted({x.group for x in batch})
    local_group = {g: i for i, g in enumerate(groups)}
    p = plan(
        [len(x) for x in batch],
        dp_size=ctx.dp_size,
        max_tokens=settings.max_tokens_per_micro_batch,
        packed=settings.pack,
    )
    rank_plan = _rank_plan(p, ctx, ctx.dp_rank)
    if ctx.dims.ep > 1:  # the MoE all-to-alls pair the EP ranks' forwards: equal counts
        count = max(len(_rank_plan(p, ctx, r)) for r in range(ctx.dp_size))
        rank_plan = split_to_count(rank_plan, count)
    pad = ctx.dims.tp if ctx.dims.uses_sequence_parallel else 1
    device = compute_device()
    if uses_thd(settings, ctx):
        return _thd_micro_batches(batch, rank_plan, ctx, pad, local_group)
    shape = (0, 0)
    if ctx.dims.vpp is not None:
        shape = (
            max(len(mb) for mb in rank_plan),
            max(sum(len(batch[i]) for i in row) for mb in rank_plan for row in mb),
        )
    return [
        collate(
            [[batch[i] for i in row] for row in mb],
            num_groups=len(groups),
            pad_to_multiple=pad,
            shape=shape,
            group_index=local_group,
        ).to(device)
        for mb in rank_plan
    ]


def _thd_micro_batches(
    batch: list[Sample],
    rank_plan: list[list[list[int]]],
    ctx: ParallelContext,
    tp_pad: int,
    local_group: dict[int, int],
) -> list[MicroBatch]:
    """``plan_micro_batches`` in THD format: this CP rank's share of each micro-batch."""
    cp = ctx.dims.cp
    multiple = (2 * cp if cp > 1 else 1) * tp_pad

    def padded(i: int) -> int:
        return -(-len(batch[i]) // multiple) * multiple

    min_length = 0
    if ctx.dims.vpp is not None:  # one shape for every micro-batch of the step
        min_length = max(sum(padded(i) for row in mb for i in row) for mb in rank_plan)
    device = compute_device()
    return [
        context_parallel_shard(
            collate_thd(
                [batch[i] for row in mb for i in row],
                num_groups=len(local_group),
                pad_to_multiple=multiple,
                min_length=min_length,
                group_index=local_group,
            ),
            cp,
            ctx.cp_rank,
        ).to(device)
        for mb in rank_plan
    ]


def _rank_plan(p, ctx: ParallelContext, dp_rank: int) -> list[list[list[int]]]:
    """The micro-batches of DP rank ``dp_rank``; a multiple of PP of them under VPP."""
    rank_plan = p.micro_batches(dp_rank)
    if ctx.dims.vpp is not None:
        rank_plan = split_to_multiple(rank_plan, ctx.dims.pp)
    return rank_plan


def forward_logprobs(
    model: list, ctx: ParallelContext, micro_batches: list[MicroBatch], *, vocab_size: int
) -> list[Tensor]:
    """Per-token log-probs of each micro-batch (0 off the loss tokens), forward only.

    Only the last pipeline stage computes them (where the loss needs them); the
    other stages get an empty list.
    """
    out: dict[int, Tensor] = {}
    replay = routing_replay(model)

    def store(batch: MicroBatch, logits: Tensor):
        logp, _ = vocab_parallel_logprobs(
            logits, batch.targets, tp_group=ctx.tp_group, vocab_size=vocab_size
        )
        out[id(batch)] = logp.detach() * batch.loss_mask
        return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

    on_forward = None if replay is None else replay.set_batch
    with torch.no_grad():
        run_schedule(model, ctx, micro_batches, store, forward_only=True, on_forward=on_forward)
    return [out[id(mb)] for mb in micro_batches] if ctx.is_last_stage else []


def prepare_global_batch(
    model: list,
    ctx: ParallelContext,
    micro_batches: list[MicroBatch],
    loss_cfg: LossConfig,
    settings: StepSettings,
    *,
    freeze_old: bool,
    ref_model: list | None = None,
) -> None:
    """What the loss needs before the first optimizer step on a global batch.

    ``freeze_old``: the policy moves between this batch's steps (mu > 1 or
    several global batches), so the behaviour log-probs are computed now.
    """
    if freeze_old:
        replay = routing_replay(model)
        with contextlib.nullcontext() if replay is None else replay.recording():  # R2
            old = forward_logprobs(model, ctx, micro_batches, vocab_size=settings.vocab_size)
        for mb, logp in zip(micro_batches, old):
            mb.old_logprobs = logp
    if ref_model is not None:
        for mb, logp in zip(
            micro_batches,
            forward_logprobs(ref_model, ctx, micro_batches, vocab_size=settings.vocab_size),
        ):
            mb.ref_logprobs = logp
    if ctx.is_last_stage:
        set_loss_weights(
            micro_batches,
            loss_cfg,
            group=ctx.dp_cp_group,
            device=compute_device(),
            count_here=ctx.cp_rank == 0,
            max_len=settings.max_len,
        )


def optimizer_step(
    model: list,
    optimizer,
    scheduler,
    ctx: ParallelContext,
    micro_batches: list[MicroBatch],
    loss_fn: LossFn[MicroBatch],
    *,
    num_sequences: int,
    on_gradients: Callable[[], None] | None = None,
    gate: Callable[[dict[str, float | None]], None] | None = None,
) -> dict[str, float | None]:
    """One optimizer step on one global batch of ``num_sequences`` sequences; its metrics,
    the same on every rank.

    ``gate`` is handed the step's loss metrics on every rank after the backward passes,
    before the optimizer consumes the gradients: it raises to stop the run with nothing
    trained (``train.gates``). ``on_gradients`` runs on every rank after the backward
    passes and the DP reduction, before the optimizer (check-invariance reads the
    gradients there). A mixture-of-experts model adds its routers' balance loss
    (``mcore.router_balance``) and logs it with the experts' load.
    """
    zero_grads(model)
    optimizer.zero_grad()
    balance, replay = router_balance(model), routing_replay(model)
    on_forward = None
    routers: contextlib.ExitStack = contextlib.ExitStack()
    if balance is not None and replay is not None:
        routers.enter_context(balance.training_step(num_sequences))
        routers.enter_context(replay.training_step())

        def on_forward(batch: MicroBatch) -> None:
            balance.set_batch(batch)
            replay.set_batch(batch)

    with routers:
        per_mb = run_schedule(model, ctx, micro_batches, loss_fn, on_forward=on_forward)
    metrics = reduce_metrics(per_mb, ctx)
    if gate is not None:
        gate(metrics)
    if on_gradients is not None:
        on_gradients()
    _, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    if balance is not None and replay is not None:
        metrics |= balance.step_metrics() | replay.step_metrics()
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    return metrics


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
    on_gradients: Callable[[], None] | None = None,
    gate: Callable[[dict[str, float | None]], None] | None = None,
) -> list[dict[str, float | None]]:
    """All optimizer steps of one rollout batch; metrics per step (same on every rank).

    ``gate`` checks the first optimizer step's metrics before its update (``optimizer_step``):
    there the learner's log-probs are those of the weights the engines were given."""
    batches = [
        plan_micro_batches(b, ctx, settings)
        for b in global_batches(samples, settings.global_batch_size)
    ]
    # The learner's own old log-probs, unless the ratio is taken against the engine's.
    freeze_old = loss_cfg.old_logprobs == "learner" and (
        settings.num_iterations > 1 or len(batches) > 1
    )
    for mbs in batches:
        prepare_global_batch(
            model, ctx, mbs, loss_cfg, settings, freeze_old=freeze_old, ref_model=ref_model
        )
    loss_fn = functools.partial(
        grpo_loss,
        cfg=loss_cfg,
        tp_group=ctx.tp_group,
        vocab_size=settings.vocab_size,
        cp_group=ctx.cp_group,
    )
    return [
        optimizer_step(
            model,
            optimizer,
            scheduler,
            ctx,
            mbs,
            loss_fn,
            num_sequences=settings.global_batch_size,
            on_gradients=on_gradients,
            gate=gate if i == 0 else None,
        )
        for i, mbs in enumerate(batches * settings.num_iterations)
    ]


def reduce_metrics(per_mb: list[dict[str, Any]], ctx: ParallelContext) -> dict[str, float | None]:
    """Token-mean metrics of one global batch, the same on every rank.

    Only one TP rank of each last-stage DP replica contributes, so nothing is
    counted twice; the sums and maxima run over the whole world so that every rank
    (first stages included) gets the numbers, the same in the same order.
    """
    keys = ("loss",) + METRIC_SUMS
    totals = torch.zeros(len(keys), dtype=torch.float64)
    maxima = torch.zeros(len(METRIC_MAXES), dtype=torch.float64)  # of values >= 0
    if ctx.is_last_stage and ctx.tp_rank == 0:
        for mb in per_mb:
            totals += torch.tensor([float(mb[k]) for k in keys], dtype=torch.float64)
            here = torch.tensor([float(mb[k]) for k in METRIC_MAXES], dtype=torch.float64)
            maxima = torch.maximum(maxima, here)
    if ctx.world_size > 1:  # one collective: every rank's sums and maxima, added up here
        local = torch.cat([totals, maxima]).to(compute_device())  # nccl moves GPU tensors only
        every = [torch.empty_like(local) for _ in range(ctx.world_size)]
        dist.all_gather(every, local)
        stacked = torch.stack(every).cpu()
        totals = stacked[:, : len(keys)].sum(0)
        maxima = stacked[:, len(keys) :].amax(0)
    sums = dict(zip(keys, totals.tolist()))
    tokens, rollout_tokens = sums["tokens"], sums["rollout_tokens"]

    def per_token(name: str, count: float = tokens) -> float | None:
        """A mean over loss tokens; None (not measured, logged as null) without any."""
        return sums[name] / count if count else None

    return {
        "loss": sums["loss"],
        "loss_tokens": tokens,
        "clip_fraction": per_token("clipped"),
        "kl": per_token("kl"),
        "entropy": per_token("entropy"),
        "is_rejected_fraction": per_token("is_rejected"),
        # Against the engine's log-probs: over the loss tokens that have them.
        "logprob_mismatch": per_token("mismatch", rollout_tokens),
        "logprob_mismatch_max": float(maxima[0]) if rollout_tokens else None,
        "rollout_kl": per_token("rollout_kl", rollout_tokens),
    }
