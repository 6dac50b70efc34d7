"""``check-invariance``: the gradient of one global batch must not depend on the layout.

One fixed global batch (varied lengths, a fully masked sequence, a masked
tool-output span, uneven prompt groups) is trained for one step at each
layout (DP x TP x PP, run as real multi-process gloo or nccl), with 1 and
several micro-batches, in the given order and under a permutation of the
samples across ranks and micro-batches. The full gradient, the parameter
update of one plain SGD step (Adam's first step is nearly sign(g) and would
hide a scale error) and the global gradient norm are compared with the
single-process run: max |delta| / max |g| must stay under the tolerance.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from megatron_grpo.algo.batch import Sample, micro_batches_for_rank
from megatron_grpo.config import LossConfig, ModelConfig, OptimConfig
from megatron_grpo.launch import run_workers

GROUP_SIZES = (4, 3, 3, 2)
"""Uneven prompt groups: 12 sequences, 4 groups."""
MAX_COMPLETION = 10


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        try:
            dp, tp, pp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"layout {text!r} is not of the form DPxTPxPP, e.g. 2x1x2") from None
        if min(dp, tp, pp) < 1:
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        return cls(dp, tp, pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"


def default_model() -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        make_vocab_size_divisible_by=8,
        max_position_embeddings=64,
    )


def default_loss(mode: str) -> LossConfig:
    """Every term switched on, so that each one is checked under the mode's weights.

    Two of the modes use the sequence-level options (GSPO ratio, sequence-level
    masked importance sampling) so that those paths are checked too.
    """
    sequence_level = mode in ("seq-mean-token-mean", "group-token-mean")
    return LossConfig(
        mode=mode,  # type: ignore[arg-type]  # checked by LossConfig
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        dual_clip=3.0,
        ratio_level="sequence" if sequence_level else "token",
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
        tis_level="sequence" if sequence_level else "token",
        tis_mode="mask" if sequence_level else "truncate",
        tis_upper=4.0 if sequence_level else 1.5,
        tis_lower=0.25 if sequence_level else None,
    )


def fixed_batch(vocab_size: int, seed: int = 0) -> tuple[list[Sample], dict[str, torch.Tensor]]:
    """The global batch, and per-token offsets that stand in for policy drift.

    old/ref/rollout log-probs are the computed log-probs plus these fixed
    offsets, so ratios differ from 1 (some clip) and KL and mismatch are non-zero.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    sample_id = 0
    for group, size in enumerate(GROUP_SIZES):
        prompt = torch.randint(
            1, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
        )
        for _ in range(size):
            n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
            completion = torch.randint(1, vocab_size, (n,), generator=g)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(n)])
            if sample_id == 5:  # fully masked (e.g. truncated and filtered)
                mask.zero_()
            if sample_id == 2 and n >= 4:  # a tool-output span inside the completion
                mask[len(prompt) + 1 : len(prompt) + 3] = 0
            reward = float(torch.randint(0, 2, (1,), generator=g))
            samples.append(
                Sample(
                    tokens=torch.cat([prompt, completion]),
                    loss_mask=mask,
                    advantage=reward - 0.5 + 0.1 * group,
                    group=group,
                    sample_id=sample_id,
                )
            )
            sample_id += 1
    length = max(len(s.tokens) for s in samples)
    offsets = {
        name: 0.3 * torch.randn(len(samples), length, generator=g)
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs")
    }
    return samples, offsets


def permutation(num_samples: int, seed: int = 1) -> list[int]:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class Variant:
    """How the global batch is laid out on a rank: micro-batch count, order, packing."""

    num_micro_batches: int
    permuted: bool = False
    packed: bool = False

    def __str__(self) -> str:
        order = "perm" if self.permuted else "orig"
        return f"mb{self.num_micro_batches}/{order}" + ("/packed" if self.packed else "")


def variants(micro_batch_counts: list[int], permute: bool, pack: bool) -> list[Variant]:
    """Each micro-batch count in order; then permuted; then permuted and packed."""
    out = [Variant(n) for n in micro_batch_counts]
    if permute:
        out += [Variant(n, permuted=True) for n in micro_batch_counts]
    if pack:
        out.append(Variant(micro_batch_counts[-1], permuted=permute, packed=True))
    return out


def run_layout(
    *,
    tp: int,
    pp: int,
    model_cfg: ModelConfig,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool,
    pack: bool = True,
    init_state: dict[str, torch.Tensor] | None,
    lr: float = 0.5,
) -> dict[str, Any] | None:
    """Worker body: every case at one layout; results on global rank 0."""
    from megatron_grpo.algo.loss import compute_logprobs, grpo_loss, set_loss_weights
    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.full_state import gather_full_state, load_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import broadcast_object, init_parallel
    from megatron_grpo.mcore.schedule import run_schedule, zero_grads

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx)
    optimizer, _ = build_optimizer(
        OptimConfig(optimizer="sgd", lr=lr, clip_grad=0.0), model_cfg, model, ctx
    )
    if init_state is None:
        init_state = gather_full_state(model, ctx, vocab_size=model_cfg.vocab_size)
        init_state = broadcast_object(init_state, ctx)
    samples, offsets = fixed_batch(model_cfg.vocab_size)
    results: dict[str, Any] = {"init_state": init_state, "cases": {}}
    for mode, variant in itertools.product(modes, variants(micro_batch_counts, permute, pack)):
        load_full_state(model, init_state, model_cfg, ctx)
        zero_grads(model)
        optimizer.zero_grad()
        order = permutation(len(samples)) if variant.permuted else range(len(samples))
        mbs = micro_batches_for_rank(
            [samples[i] for i in order],
            dp_size=ctx.dp_size,
            dp_rank=ctx.dp_rank,
            num_micro_batches=variant.num_micro_batches,
            pack=variant.packed,
        )
        compute_logprobs(model, ctx, mbs, vocab_size=model_cfg.vocab_size)
        if ctx.is_last_stage:
            for mb in mbs:
                sample = mb["sample_ids"][mb["seg"].clamp(min=0)]
                drift = {k: v[sample, mb["position_ids"]] for k, v in offsets.items()}
                mb["ref_logprobs"] = mb["old_logprobs"] + drift["ref_logprobs"]
                mb["rollout_logprobs"] = mb["old_logprobs"] + drift["rollout_logprobs"]
                mb["old_logprobs"] = mb["old_logprobs"] + drift["old_logprobs"]
        loss_cfg = default_loss(mode)
        set_loss_weights(mbs, loss_cfg, ctx, num_groups=len(GROUP_SIZES), max_len=MAX_COMPLETION)
        loss_fn = functools.partial(
            grpo_loss, cfg=loss_cfg, tp_group=ctx.tp_group, vocab_size=model_cfg.vocab_size
        )
        run_schedule(model, ctx, mbs, loss_fn)
        grads = gather_full_state(model, ctx, vocab_size=model_cfg.vocab_size, grads=True)
        _, grad_norm, _ = optimizer.step()
        params = gather_full_state(model, ctx, vocab_size=model_cfg.vocab_size)
        if ctx.is_main:
            assert grads is not None and params is not None
            results["cases"][f"{mode}/{variant}"] = {
                "grad": grads,
                "update": {k: params[k] - init_state[k] for k in params},
                "grad_norm": float(grad_norm),
            }
    return results if ctx.is_main else None


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max over tensors of |got - ref|, divided by max over tensors of |ref|."""
    if set(got) != set(ref):
        raise AssertionError(f"tensor names differ: {sorted(set(got) ^ set(ref))}")
    scale = max(float(t.abs().max()) for t in ref.values())
    delta = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    return delta / scale if scale > 0 else delta


def compare(case: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    return {
        "grad": max_relative_error(case["grad"], ref["grad"]),
        "update": max_relative_error(case["update"], ref["update"]),
        "grad_norm": abs(case["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30),
    }


def check(
    layouts: list[Layout],
    *,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool = True,
    pack: bool = True,
    model_cfg: ModelConfig | None = None,
    timeout: float = 600.0,
    log=print,
    worker: str | None = None,
    worker_kwargs: dict[str, Any] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """errors[layout][case] = {grad, update, grad_norm}, each case against 1x1x1.

    The reference of every case is the single-process run of the same mode
    with the first micro-batch count, in the original order. ``worker``
    ("module:function" taking run_layout's arguments and ``worker_kwargs``)
    replaces the worker body, e.g. to plant a bug and see the check catch it.
    """
    model_cfg = model_cfg or default_model()
    common = dict(
        model_cfg=model_cfg,
        modes=modes,
        micro_batch_counts=micro_batch_counts,
        permute=permute,
        pack=pack,
        **(worker_kwargs or {}),
    )
    target = worker or f"{__name__}:run_layout"

    def launch(layout: Layout, init_state) -> dict[str, Any]:
        kwargs = {**common, "tp": layout.tp, "pp": layout.pp, "init_state": init_state}
        results = run_workers(target, layout.world_size, kwargs=kwargs, timeout=timeout)
        return next(r for r in results if r is not None)

    reference = launch(Layout(1, 1, 1), None)
    first = Variant(micro_batch_counts[0])
    baseline = {m: reference["cases"][f"{m}/{first}"] for m in modes}
    errors: dict[str, dict[str, dict[str, float]]] = {}
    for layout in [Layout(1, 1, 1)] + [x for x in layouts if x != Layout(1, 1, 1)]:
        cases = reference if layout == Layout(1, 1, 1) else launch(layout, reference["init_state"])
        errors[str(layout)] = {
            name: compare(case, baseline[name.split("/")[0]])
            for name, case in cases["cases"].items()
        }
        log(_summary(str(layout), errors[str(layout)]))
    return errors


def _summary(layout: str, errors: dict[str, dict[str, float]]) -> str:
    worst = {k: max(e[k] for e in errors.values()) for k in ("grad", "update", "grad_norm")}
    return (
        f"layout {layout:>7}: {len(errors)} cases, max |dg|/max|g| = {worst['grad']:.2e}, "
        f"update {worst['update']:.2e}, grad norm {worst['grad_norm']:.2e}"
    )
