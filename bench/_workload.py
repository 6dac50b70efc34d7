"""Synthetic GRPO batches and the two train steps compared: GRPO and plain cross-entropy.

The samples look like a rollout batch: prompt groups sharing a prompt, completions of
varied lengths, an advantage per sample and the rollout engine's log-probs on the
completion tokens. They are laid out exactly as the trainer lays them out
(``plan.plan`` over the DP ranks under a token budget, then ``batch.collate``).

``grpo_step`` is one optimizer step of ``train_step.train_on_rollout`` for one
global batch (denominators with their one DP all-reduce, the schedule with
``grpo_loss``, the optimizer, the metric reduction), with the old and
reference log-probs already in the micro-batches. ``ce_step`` is the same
schedule and optimizer with megatron-core's ``vocab_parallel_cross_entropy``
as the loss: the step megatron-core's own pretraining would take on the
same tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.algo.batch import Sample, collate
from megatron_grpo.config import LossConfig, ModelConfig
from megatron_grpo.mcore.parallel import ParallelContext
from megatron_grpo.train.plan import plan


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


def micro_batches(
    samples: list[Sample], shape: BatchShape, ctx: ParallelContext
) -> list[dict[str, Any]]:
    """This rank's micro-batches, as ``train_step`` builds them."""
    p = plan(
        [len(s) for s in samples],
        dp_size=ctx.dp_size,
        max_tokens=shape.max_tokens_per_micro_batch,
        packed=shape.pack,
    )
    mbs = [
        collate([[samples[i] for i in row] for row in mb]) for mb in p.micro_batches(ctx.dp_rank)
    ]
    num_groups = len({s.group for s in samples})
    for mb in mbs:
        mb["num_groups"] = num_groups
    return mbs


PER_SAMPLE_KEYS = ("seq_tokens", "group_ids", "sample_ids")
"""Per-sample vectors that ``set_loss_weights`` combines with CPU tensors: kept on the CPU."""


def to_device(mbs: list[dict[str, Any]], device: torch.device) -> None:
    """Move the per-position tensors of the micro-batches to ``device`` (in place).

    The trainer itself leaves micro-batches on the CPU; on a GPU the model
    needs its inputs there, while the denominators are computed from the
    per-sample vectors on the CPU, so those stay.
    """
    for mb in mbs:
        for key, value in mb.items():
            if isinstance(value, torch.Tensor) and key not in PER_SAMPLE_KEYS:
                mb[key] = value.to(device, non_blocking=True)


def add_reference_logprobs(mbs: list[dict[str, Any]], seed: int = 0) -> None:
    """Reference log-probs near the old ones (KL is non-zero); last stage only holds "old"."""
    g = torch.Generator().manual_seed(seed)
    for mb in mbs:
        if "old_logprobs" in mb:
            old = mb["old_logprobs"]
            noise = 0.05 * torch.randn(old.shape, generator=g).to(old.device)
            mb["ref_logprobs"] = old + noise * mb["loss_mask"]


def ce_loss(batch: dict[str, Any], logits: torch.Tensor, *, scale: float):
    """megatron-core's vocab-parallel cross-entropy, summed over loss tokens and scaled."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = vocab_parallel_cross_entropy(logits.float(), batch["targets"])
    mask = batch["loss_mask"]
    loss = (per_token * mask).sum() * scale
    num_tokens = mask.sum()
    return loss, num_tokens.to(torch.int), {"loss": loss.detach()}


def num_loss_tokens(samples: list[Sample]) -> int:
    return sum(s.num_loss_tokens for s in samples)


class Steps:
    """The two optimizer steps and the old-logprob pass on one model and one batch."""

    def __init__(
        self,
        model: list,
        optimizer,
        ctx: ParallelContext,
        mbs: list[dict[str, Any]],
        *,
        model_cfg: ModelConfig,
        loss_cfg: LossConfig,
        total_loss_tokens: int,
        max_len: int,
    ) -> None:
        from megatron_grpo.algo.loss import grpo_loss

        self.model, self.optimizer, self.ctx, self.mbs = model, optimizer, ctx, mbs
        self.model_cfg, self.loss_cfg, self.max_len = model_cfg, loss_cfg, max_len
        self.grpo_fn = functools.partial(
            grpo_loss, cfg=loss_cfg, tp_group=ctx.tp_group, vocab_size=model_cfg.vocab_size
        )
        self.ce_fn = functools.partial(ce_loss, scale=1.0 / max(total_loss_tokens, 1))

    def old_logprobs(self) -> None:
        """The forward-only pass that freezes the behaviour policy's log-probs."""
        from megatron_grpo.algo.loss import compute_logprobs

        compute_logprobs(self.model, self.ctx, self.mbs, vocab_size=self.model_cfg.vocab_size)

    def grpo(self) -> dict[str, float]:
        from megatron_grpo.algo.loss import set_loss_weights
        from megatron_grpo.mcore.schedule import run_schedule, zero_grads
        from megatron_grpo.train.step import reduce_metrics

        zero_grads(self.model)
        self.optimizer.zero_grad()
        set_loss_weights(
            self.mbs,
            self.loss_cfg,
            self.ctx,
            num_groups=self.mbs[0]["num_groups"],
            max_len=self.max_len,
        )
        for mb in self.mbs:  # weights come back where the counts were computed: the CPU
            if "loss_weights" in mb:
                mb["loss_weights"] = mb["loss_weights"].to(mb["tokens"].device)
        per_mb = run_schedule(self.model, self.ctx, self.mbs, self.grpo_fn)
        self.optimizer.step()
        return reduce_metrics(per_mb, self.ctx)

    def ce(self) -> None:
        from megatron_grpo.mcore.schedule import run_schedule, zero_grads

        zero_grads(self.model)
        self.optimizer.zero_grad()
        run_schedule(self.model, self.ctx, self.mbs, self.ce_fn)
        self.optimizer.step()
