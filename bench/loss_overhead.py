"""GRPO train-step time vs a plain megatron-core cross-entropy step: same tokens, same layout.

    python bench/loss_overhead.py                      # DP2 and TP2 on gloo, 4 layers, hidden 256
    python bench/loss_overhead.py --layouts 2x1x1 --repeats 20
    python bench/loss_overhead.py --quick              # smoke test

Per layout, one multi-process run builds one model and one batch and then, in
each repeat and in rotating order, times:
- ``ce``: a megatron-core step with ``vocab_parallel_cross_entropy`` as the loss;
- ``grpo``: the trainer's step for one global batch (denominators with their
  one DP all-reduce, ``grpo_loss`` with clipping, KL, entropy and truncated
  importance sampling, the optimizer, the metric reduction), old and
  reference log-probs already present;
- ``grpo_no_entropy_bonus``: ``grpo`` with the entropy bonus off (entropy
  still reported as a metric, without its gradient);
- ``old``: the forward-only pass computing the old log-probs, which the
  trainer runs only when the policy moves within a rollout batch (mu > 1 or
  several optimizer steps per rollout). The reference-model pass (KL on) is
  one more forward of the same cost.

Reported ratios: grpo / ce ("step only", target <= 1.10), the same without the
entropy bonus, and (grpo + old) / ce ("with old-logprob pass"). Where the time
goes: the loss functions alone (forward + backward on one micro-batch's logits)
are timed the same way:
megatron's cross-entropy, log-probs only, log-probs + entropy, full ``grpo_loss``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace

from _common import (
    Ratio,
    interleaved,
    parser,
    ratios,
    run_at_layout,
    seconds,
    sum_over_ranks,
    tiny_model,
    write_result,
)

TARGET = 1.10


def model_config(quick: bool, vocab_size: int | None):
    from megatron_grpo.config import ModelConfig

    if quick:
        return tiny_model(vocab_size=vocab_size or 500, max_position_embeddings=512)
    # Qwen-like proportions at a CPU size; vocab / hidden = 62 (Qwen3-1.7B: 74, 8B: 37).
    return ModelConfig(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=768,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=vocab_size or 16000,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=2048,
        qk_layernorm=True,
    )


def batch_shape(quick: bool, pack: bool):
    from _workload import BatchShape

    if quick:
        return BatchShape(
            num_samples=8,
            group_size=4,
            prompt_len=(4, 12),
            completion_len=(4, 24),
            max_tokens_per_micro_batch=64,
            pack=pack,
        )
    return BatchShape(
        num_samples=16,
        group_size=4,
        prompt_len=(32, 64),
        completion_len=(32, 224),
        max_tokens_per_micro_batch=1024,
        pack=pack,
    )


def worker(*, tp: int, pp: int, model_cfg, shape, repeats: int, warmup: int) -> dict | None:
    """One layout: interleaved step timings and the loss-function breakdown (on rank 0)."""
    import torch.distributed as dist
    from _workload import (
        Steps,
        add_reference_logprobs,
        full_loss_config,
        make_samples,
        micro_batches,
        num_loss_tokens,
        settings,
    )

    from megatron_grpo.config import OptimConfig, ParallelDims
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx)
    optimizer, scheduler = build_optimizer(
        OptimConfig(optimizer="adam", lr=1e-6, clip_grad=1.0), model_cfg, model, ctx
    )
    samples = make_samples(shape, model_cfg.vocab_size)
    mbs = micro_batches(samples, shape, ctx, model_cfg.vocab_size)
    common = dict(
        model_cfg=model_cfg,
        step_settings=settings(shape, model_cfg.vocab_size),
        total_loss_tokens=num_loss_tokens(samples),
    )
    steps = Steps(model, optimizer, scheduler, ctx, mbs, loss_cfg=full_loss_config(), **common)
    # The same step with the entropy bonus off (its default in DAPO, Dr. GRPO and slime): the
    # entropy is then a metric only and its gradient, an extra pass over the logits, is skipped.
    no_bonus = Steps(
        model,
        optimizer,
        scheduler,
        ctx,
        mbs,
        loss_cfg=replace(full_loss_config(), entropy_coef=0.0),
        **common,
    )
    steps.old_logprobs()
    add_reference_logprobs(mbs)

    def synced(fn):
        def run() -> None:
            dist.barrier()
            fn()
            dist.barrier()

        return run

    times = interleaved(
        {
            "ce": synced(steps.ce),
            "grpo": synced(steps.grpo),
            "grpo_no_entropy_bonus": synced(no_bonus.grpo),
            "old": synced(steps.old_logprobs),
        },
        repeats=repeats,
        warmup=warmup,
    )
    metrics = steps.grpo()
    breakdown = _loss_breakdown(steps, ctx, repeats=repeats, warmup=warmup)
    times = sum_over_ranks(times)
    breakdown = sum_over_ranks(breakdown)
    if ctx.rank != 0:
        return None
    return {
        "times": times,
        "breakdown": breakdown,
        "last_grpo_metrics": metrics,
        "tokens_per_rank": sum(int((mb.seg >= 0).sum()) for mb in mbs),
        "micro_batches_on_rank0": len(mbs),
        "micro_batch_widths_on_rank0": [int(mb.tokens.shape[1]) for mb in mbs],
        "dp": ctx.dp_size,
    }


def _loss_breakdown(steps, ctx, *, repeats: int, warmup: int) -> dict:
    """Forward + backward of each loss function alone on the widest micro-batch's logits."""
    import torch
    from _workload import ce_loss

    from megatron_grpo.algo.logprobs import vocab_parallel_logprobs

    if not ctx.is_last_stage:  # no loss here: empty timings, counted as zero CPU
        return {}
    mb = max(steps.mbs, key=lambda m: m.tokens.numel())
    local_vocab = steps.model_cfg.padded_vocab_size(ctx.dims.tp) // ctx.dims.tp
    g = torch.Generator().manual_seed(ctx.rank)
    base = torch.randn(*mb.tokens.shape, local_vocab, generator=g)
    vocab, mask = steps.model_cfg.vocab_size, mb.loss_mask

    def logprobs_only(logits):
        logp, _ = vocab_parallel_logprobs(
            logits, mb.targets, tp_group=ctx.tp_group, vocab_size=vocab
        )
        return (logp * mask).sum()

    def logprobs_entropy(logits):
        logp, ent = vocab_parallel_logprobs(
            logits, mb.targets, tp_group=ctx.tp_group, vocab_size=vocab, with_entropy=True
        )
        return ((logp + 0.001 * ent) * mask).sum()

    losses = {
        "loss_ce": lambda logits: ce_loss(mb, logits, scale=1.0)[0],
        "loss_logprobs": logprobs_only,
        "loss_logprobs_entropy": logprobs_entropy,
        "loss_grpo": lambda logits: steps.grpo_fn(mb, logits)[0],
    }

    def forward_backward(loss):
        return lambda: loss(base.clone().requires_grad_(True)).backward()

    return interleaved(
        {name: forward_backward(fn) for name, fn in losses.items()},
        repeats=repeats,
        warmup=warmup,
    )


def report_layout(layout, out: dict) -> tuple[dict, bool]:
    """Print one layout's ratios; its JSON entry and whether the step target was met."""
    times, breakdown = out.pop("times"), out.pop("breakdown")

    def ratio(name: str, numerators: list[str], denominator: str, clock: str) -> Ratio:
        return Ratio.of(f"{layout} {name} [{clock}]", ratios(times, numerators, denominator, clock))

    clocks = ("cpu", "wall")
    step = {c: ratio("grpo_step/ce_step", ["grpo"], "ce", c) for c in clocks}
    no_bonus = {
        c: ratio("grpo_step_without_entropy_bonus/ce_step", ["grpo_no_entropy_bonus"], "ce", c)
        for c in clocks
    }
    with_old = {
        c: ratio("(grpo_step+old_logprob_pass)/ce_step", ["grpo", "old"], "ce", c) for c in clocks
    }
    for clock in clocks:
        print(step[clock].line(TARGET))
        print(no_bonus[clock].line(TARGET))
        print(with_old[clock].line())
    loss_fn = {
        name: Ratio.of(
            f"{layout} {name}/loss_ce fwd+bwd [cpu]",
            ratios(breakdown, [name], "loss_ce", "cpu"),
        )
        for name in ("loss_logprobs", "loss_logprobs_entropy", "loss_grpo")
    }
    for r in loss_fn.values():
        print("  " + r.line())
    cpu = {k: statistics.median(t.cpu for t in v) for k, v in {**times, **breakdown}.items()}
    print(
        f"  {layout} CPU seconds (all ranks): ce step {cpu['ce']:.2f}, grpo step "
        f"{cpu['grpo']:.2f}, old-logprob pass {cpu['old']:.2f}; per micro-batch, over "
        f"megatron's CE {cpu['loss_ce']:.3f}: log-probs "
        f"{cpu['loss_logprobs'] - cpu['loss_ce']:+.3f}, entropy "
        f"{cpu['loss_logprobs_entropy'] - cpu['loss_logprobs']:+.3f}, rest of grpo_loss "
        f"{cpu['loss_grpo'] - cpu['loss_logprobs_entropy']:+.3f} "
        f"({out['micro_batches_on_rank0']} micro-batches on rank 0)"
    )
    entry = {
        "step_only": step,
        "step_only_without_entropy_bonus": no_bonus,
        "with_old_logprob_pass": with_old,
        "loss_fn_vs_ce": loss_fn,
        "seconds": seconds(times),
        "loss_fn_seconds": seconds(breakdown),
        **out,
    }
    return entry, step["cpu"].median <= TARGET


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layouts", help="comma-separated DPxTPxPP, default 2x1x1,1x2x1")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--no-pack", action="store_true", help="unpacked micro-batches")
    p.add_argument(
        "--timeout", type=float, help="seconds per launch (default 900; 150 with --quick)"
    )
    args = p.parse_args()

    from megatron_grpo.commands.invariance import Layout

    layouts = [
        Layout.parse(x)
        for x in (args.layouts or ("2x1x1" if args.quick else "2x1x1,1x2x1")).split(",")
    ]
    repeats = args.repeats or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 2)
    model_cfg = model_config(args.quick, args.vocab_size)
    shape = batch_shape(args.quick, pack=not args.no_pack)
    results, met = {}, True
    for layout in layouts:
        out = run_at_layout(
            __file__,
            layout,
            timeout=args.timeout or (150.0 if args.quick else 900.0),
            model_cfg=model_cfg,
            shape=shape,
            repeats=repeats,
            warmup=warmup,
        )[0]
        results[str(layout)], layout_met = report_layout(layout, out)
        met &= layout_met
    write_result(
        "loss_overhead",
        args.out,
        {
            "quick": args.quick,
            "target": {"grpo_step/ce_step (CPU time)": f"<= {TARGET}", "met": met},
            "model": asdict(model_cfg),
            "batch": asdict(shape),
            "repeats": repeats,
            "warmup": warmup,
            "layouts": results,
        },
    )


if __name__ == "__main__":
    main()
