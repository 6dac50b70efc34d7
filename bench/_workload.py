"""Synthetic GRPO batches and the two train steps compared: GRPO and plain cross-entropy.

The samples look like a rollout batch: prompt groups sharing a prompt, completions of
varied lengths, an advantage per sample and the rollout engine's log-probs on the
completion tokens. They are laid out by the trainer's own planner
(``train.step.plan_micro_batches``).

Both steps are the trainer's ``train.step.optimizer_step`` (zero the gradients, the
schedule, the optimizer, the LR schedule, the metric reduction) on the same
micro-batches; only the loss differs. ``grpo`` uses ``grpo_loss`` with the weights
set by ``prepare_global_batch`` (the denominators' one DP all-reduce) and the old and
reference log-probs in the micro-batches; ``ce`` uses megatron-core's
``vocab_parallel_cross_entropy``: the step megatron-core's own pretraining would take
on the same tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_grpo.algo.batch import MicroBatch, Sample
from megatron_grpo.algo.loss import METRIC_MAXES, METRIC_SUMS
from megatron_grpo.config import LossConfig, ModelConfig
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.train.step import StepSettings, plan_micro_batches


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    num_samples: int
    group_size: int
    prompt_len: tuple[int, int]
    """Inclusive range of prompt lengths (uniform)."""
    completion_len: tuple[int, int]
    """Inclusive range of completion lengths (uniform)."""
    max_tokens_per_micro_batch: int
    pack: bool


def full_loss_config() -> LossConfig:
    """Every term of the GRPO loss switched on: clipping, KL, entropy, truncated IS."""
    return LossConfig(
        mode="token-mean",
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        kl_coef=0.01,
        kl_estimator="k3",
        entropy_coef=0.001,
        tis_level="token",
        tis_mode="truncate",
        tis_upper=2.0,
    )


def make_samples(shape: BatchShape, vocab_size: int, seed: int = 0) -> list[Sample]:
    if shape.num_samples % shape.group_size:
        raise ValueError("num_samples must be a multiple of group_size")
    g = torch.Generator().manual_seed(seed)

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))

    samples = []
    for group in range(shape.num_samples // shape.group_size):
        prompt = torch.randint(1, vocab_size, (draw(shape.prompt_len),), generator=g)
        for _ in range(shape.group_size):
            n = draw(shape.completion_len)
            completion = torch.randint(1, vocab_size, (n,), generator=g)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(n)])
            rollout = -torch.rand(len(prompt) + n, generator=g) * 3.0 * mask
            samples.append(
                Sample(
                    tokens=torch.cat([prompt, completion]),
                    loss_mask=mask,
                    advantage=float(torch.randn((), generator=g)),
                    group=group,
                    sample_id=len(samples),
                    rollout_logprobs=rollout,
                )
            )
    return samples


def settings(shape: BatchShape, vocab_size: int) -> StepSettings:
    """The trainer's settings for one optimizer step on the whole batch."""
    return StepSettings(
        global_batch_size=shape.num_samples,
        num_iterations=1,
        max_tokens_per_micro_batch=shape.max_tokens_per_micro_batch,
        pack=shape.pack,
        vocab_size=vocab_size,
        max_len=shape.completion_len[1],
    )


def micro_batches(
    samples: list[Sample], shape: BatchShape, ctx: ParallelContext, vocab_size: int
) -> list[MicroBatch]:
    """This rank's micro-batches, planned as the trainer plans them."""
    return plan_micro_batches(samples, ctx, settings(shape, vocab_size))


def add_reference_logprobs(mbs: list[MicroBatch], seed: int = 0) -> None:
    """Reference log-probs near the old ones (KL is non-zero); last stage only holds "old"."""
    g = torch.Generator().manual_seed(seed)
    for mb in mbs:
        if mb.old_logprobs is not None:
            old = mb.old_logprobs
            noise = 0.05 * torch.randn(old.shape, generator=g).to(old.device)
            mb.ref_logprobs = old + noise * mb.loss_mask


def ce_loss(batch: MicroBatch, logits: torch.Tensor, *, scale: float):
    """megatron-core's vocab-parallel cross-entropy, summed over loss tokens and scaled."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = vocab_parallel_cross_entropy(logits.float(), batch.targets)
    mask = batch.loss_mask
    loss = (per_token * mask).sum() * scale
    num_tokens = mask.sum()
    zero = loss.new_zeros(())
    metrics = {k: zero for k in METRIC_SUMS + METRIC_MAXES}
    metrics |= {"loss": loss.detach(), "tokens": num_tokens}
    return loss, num_tokens.to(torch.int), metrics


def num_loss_tokens(samples: list[Sample]) -> int:
    return sum(s.num_loss_tokens for s in samples)


class Steps:
    """The two optimizer steps and the old-logprob pass on one model and one batch."""

    def __init__(
        self,
        model: list,
        optimizer,
        scheduler,
        ctx: ParallelContext,
        mbs: list[MicroBatch],
        *,
        model_cfg: ModelConfig,
        loss_cfg: LossConfig,
        step_settings: StepSettings,
        total_loss_tokens: int,
    ) -> None:
        from megatron_grpo.algo.loss import grpo_loss

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.ctx, self.mbs, self.settings = ctx, mbs, step_settings
        self.model_cfg, self.loss_cfg = model_cfg, loss_cfg
        self.grpo_fn = functools.partial(
            grpo_loss, cfg=loss_cfg, tp_group=ctx.tp_group, vocab_size=model_cfg.vocab_size
        )
        self.ce_fn = functools.partial(ce_loss, scale=1.0 / max(total_loss_tokens, 1))

    def old_logprobs(self) -> None:
        """The forward-only pass that freezes the behaviour policy's log-probs."""
        from megatron_grpo.train.step import forward_logprobs

        logps = forward_logprobs(
            self.model, self.ctx, self.mbs, vocab_size=self.model_cfg.vocab_size
        )
        for mb, logp in zip(self.mbs, logps):
            mb.old_logprobs = logp

    def grpo(self) -> dict[str, float]:
        """The trainer's step: the loss weights (one DP all-reduce), then the optimizer step."""
        from megatron_grpo.train.step import optimizer_step, prepare_global_batch

        prepare_global_batch(
            self.model, self.ctx, self.mbs, self.loss_cfg, self.settings, freeze_old=False
        )
        return optimizer_step(
            self.model,
            self.optimizer,
            self.scheduler,
            self.ctx,
            self.mbs,
            self.grpo_fn,
            num_sequences=self.settings.global_batch_size,
        )

    def ce(self) -> None:
        from megatron_grpo.train.step import optimizer_step

        optimizer_step(
            self.model,
            self.optimizer,
            self.scheduler,
            self.ctx,
            self.mbs,
            self.ce_fn,
            num_sequences=self.settings.global_batch_size,
        )
