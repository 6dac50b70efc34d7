"""The body each rank of a check-invariance launch runs: every case at one layout, through
the trainer's own step function (``train.step.train_on_rollout``)."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from megatron_grpo.commands.invariance.cases import (
    MAX_COMPLETION,
    NUM_ITERATIONS,
    REF_NOISE,
    Layout,
    Variant,
    default_loss,
    permutation,
    setup,
    variants,
    with_routes,
)
from megatron_grpo.config import ModelConfig


def _reference_state(init_state: dict[str, torch.Tensor], seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return {k: v + REF_NOISE * torch.randn(v.shape, generator=g) for k, v in init_state.items()}


def _gather(model: list, ctx, vocab_size: int, *, grads: bool):
    """(full tensors, largest difference between replicas of each) on rank 0. Collective."""
    from megatron_grpo.mcore.full_state import gather_full_state

    spread: dict[str, float] = {}
    full = gather_full_state(model, ctx, vocab_size=vocab_size, grads=grads, replica_spread=spread)
    return full, max(spread.values(), default=0.0)


def _capture(model: list, ctx, vocab_size: int, with_grads: bool, into: list) -> None:
    """Gradients and parameters before an optimizer step, full, on rank 0. Collective."""
    grads, grad_spread = _gather(model, ctx, vocab_size, grads=True) if with_grads else (None, 0.0)
    params, param_spread = _gather(model, ctx, vocab_size, grads=False)
    into.append(
        {"grad": grads, "params": params, "spread": (grad_spread, param_spread)}
        if ctx.is_main
        else None
    )


def _replicas(spread: tuple[float, float], grad, update) -> float:
    """Disagreement between copies of one tensor, relative to the gradient or the update."""
    grad_spread, param_spread = spread
    out = param_spread / max(max(float(t.abs().max()) for t in update.values()), 1e-30)
    if grad is not None:
        out = max(out, grad_spread / max(max(float(t.abs().max()) for t in grad.values()), 1e-30))
    return out


def _passes(before: list, final: dict, history: list, micro_batches: list[int]) -> list[dict]:
    """One result per optimizer pass: the gradient and parameters captured before it, the
    update it made (to the next capture, or to ``final``), its metrics."""
    after = [b["params"] for b in before[1:]] + [final]
    out = []
    for b, params, metrics in zip(before, after, history):
        update = {name: params[name] - b["params"][name] for name in params}
        out.append(
            {
                "grad": b["grad"],
                "update": update,
                "params": params,
                "grad_norm": metrics["grad_norm"],
                "replicas": _replicas(b["spread"], b["grad"], update),
                "clip_fraction": metrics["clip_fraction"],
                "kl": metrics["kl"],
                "moe_aux_loss": metrics.get("moe_aux_loss"),
                "micro_batches": micro_batches,
            }
        )
    return out


def _outside_megatron(init_state: dict, ref_state: dict, run, mode: str, batch: list) -> dict:
    """The first pass's gradient on ``batch``, computed with transformers."""
    from megatron_grpo.commands.invariance.reference import reference_gradient

    loss = default_loss(mode)
    return reference_gradient(
        init_state,
        ref_state,
        batch,
        run.model,
        loss,
        max_len=MAX_COMPLETION,
        replay=run.train.routing_replay == "r3",
    )


def run_layout(
    *,
    tp: int,
    pp: int,
    dp: int,
    ep: int = 1,
    cp: int = 1,
    model_cfg: ModelConfig,
    modes: list[str],
    micro_batch_counts: list[int],
    permute: bool,
    pack: bool = True,
    features: tuple[str, ...] = (),
    init_state: dict[str, torch.Tensor] | None,
    ref_state: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Every case at one layout; results on rank 0. Without ``init_state`` this is the
    single-process reference: it draws the initial and reference weights and also computes
    the first pass's gradient outside megatron-core (``reference.reference_gradient``)."""
    from megatron_grpo.mcore.full_state import load_full_state
    from megatron_grpo.mcore.layers import have_transformer_engine
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import broadcast_object, init_parallel
    from megatron_grpo.train.plan import plan
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    is_reference = init_state is None
    run = setup(Layout(dp, tp, pp, ep, cp), features, model_cfg, reference=is_reference)
    ctx = init_parallel(run.dims)
    model = build_model(run.model, ctx, optim=run.optim, train=run.train)
    vocab = run.model.vocab_size
    if init_state is None:
        init_state = broadcast_object(_gather(model, ctx, vocab, grads=False)[0], ctx)
        ref_state = _reference_state(init_state)
    assert ref_state is not None
    ref_model = build_model(run.model, ctx, wrap_ddp=False)
    load_full_state(ref_model, ref_state, run.model, ctx)
    results: dict[str, Any] = dict(init_state=init_state, ref_state=ref_state, active=run.active)
    results |= {"cases": {}, "transformers": {}}
    # Transformer Engine takes packed (THD) rows in 16-bit only: in float32 there, no packing.
    pack = pack and (run.model.params_dtype != "float32" or not have_transformer_engine())
    layouts = variants(micro_batch_counts, permute, pack, empty_rank="vpp" not in run.active)
    # the first variant of the fixed and the sparse-groups batch, also computed outside
    outside = [Variant(micro_batch_counts[0], global_batch=b) for b in ("fixed", "sparse-groups")]
    for mode, variant in itertools.product(modes, layouts):
        load_full_state(model, init_state, run.model, ctx)
        optimizer, scheduler = build_optimizer(run.optim, run.model, model, ctx)  # fresh state
        samples = variant.batch(vocab)
        if run.train.routing_replay == "r3":
            samples = with_routes(samples, run.model)
        order = permutation(len(samples)) if variant.permuted else range(len(samples))
        batch = [samples[i] for i in order]
        lengths = [len(s) for s in batch]
        settings = StepSettings(
            global_batch_size=len(batch),
            num_iterations=NUM_ITERATIONS,
            max_tokens_per_micro_batch=variant.token_budget(lengths, ctx.dp_size),
            pack=variant.packed,
            vocab_size=vocab,
            max_len=MAX_COMPLETION,
        )
        before: list[dict[str, Any] | None] = []
        capture = functools.partial(_capture, model, ctx, vocab, run.compares_grads, before)
        history = train_on_rollout(
            model,
            optimizer,
            scheduler,
            ctx,
            batch,
            default_loss(mode),
            settings,
            ref_model=ref_model,
            on_gradients=capture,
        )
        final = _gather(model, ctx, vocab, grads=False)[0]
        if not ctx.is_main:
            continue
        budget = settings.max_tokens_per_micro_batch
        split = plan(lengths, dp_size=ctx.dp_size, max_tokens=budget, packed=variant.packed)
        counts = [len(rank) for rank in split.ranks]
        groups = [
            sorted({batch[i].group for mb in r for row in mb for i in row}) for r in split.ranks
        ]
        for k, case in enumerate(_passes(before, final, history, counts), start=1):
            results["cases"][f"{mode}/{variant}/pass{k}"] = case | {"groups": groups}
        if is_reference and variant in outside:
            key = mode if variant.global_batch == "fixed" else f"{mode}/{variant.global_batch}"
            results["transformers"][key] = _outside_megatron(
                init_state, ref_state, run, mode, samples
            )
    return results if ctx.is_main else None
