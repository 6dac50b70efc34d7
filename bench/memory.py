"""Peak resident memory per rank: the distributed optimizer and recomputation on vs off,
measured side by side, next to the dry run's estimate of the same config.

    python bench/memory.py              # ~120M-parameter model, DP2 and TP2 on gloo
    python bench/memory.py --quick      # smoke test: a tiny model

Each case is one 2-process launch that builds the model and the optimizer and runs the
trainer's own ``train.step.train_on_rollout`` twice on the same synthetic rollout batch
(fp32, Adam). A thread samples every rank's resident set (``/proc/self/statm``) every
millisecond; glibc is told to return freed memory at once (``MALLOC_ENV``). Per rank it
reports, above the resident set before the model was built:

- ``model_states``: at rest after the first step (weights, the fp32 gradient buffer,
  the optimizer state, which Adam allocates in its first step);
- ``optimizer``: what the first step left behind, i.e. the optimizer state;
- ``peak``: the peak during the second step (model states + activations + logits).

The dry run's figures are for the same config, at the same world size, with the local
layer spec's unfused attention (``unfused_attention=True``) and without the 5 GiB it
reserves for a GPU's CUDA context. Ratios reported: optimizer memory without / with the
distributed optimizer (DP2, about DP expected), peak without / with recomputation, and
measured peak / dry-run estimate per case (target: within 25%).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from _common import parser, run_at_layout, write_result

from megatron_grpo.testing.memory import MALLOC_ENV, ResidentPeak, rss

TOLERANCE = 0.25
"""glibc malloc settings for the workers: every allocation above 64 KiB gets its own
mapping, returned to the system when freed (the default threshold grows after the first
large free, after which freed tensors stay resident and blur what is live)."""


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    """DPxTPxPP."""
    distopt: bool
    recompute: bool


CASES = (
    Case("dp2", "2x1x1", distopt=False, recompute=False),
    Case("dp2_distopt", "2x1x1", distopt=True, recompute=False),
    Case("dp2_recompute", "2x1x1", distopt=False, recompute=True),
    Case("dp2_distopt_recompute", "2x1x1", distopt=True, recompute=True),
    Case("tp2_sp", "1x2x1", distopt=False, recompute=False),
    Case("tp2_sp_recompute", "1x2x1", distopt=False, recompute=True),
)


def model_config(quick: bool):
    from megatron_grpo.config import ModelConfig

    if quick:
        from _common import tiny_model

        return tiny_model(vocab_size=512)
    # 8 layers of 1024 (16 heads of 64, 4 query groups), SwiGLU 2816, vocabulary 8192:
    # 107M parameters, 1.6 GiB of fp32 model states with Adam.
    return ModelConfig(
        num_layers=8,
        hidden_size=1024,
        ffn_hidden_size=2816,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=8192,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=1024,
    )


def configs(case: Case, quick: bool):
    """(model, optim, train, parallel dims, row length, rows per rank) for ``case``."""
    from megatron_grpo.commands.invariance import Layout
    from megatron_grpo.config import OptimConfig, ParallelDims, TrainConfig

    layout = Layout.parse(case.layout)
    row = 32 if quick else 256
    tokens = 4 * row
    optim = OptimConfig(
        optimizer="adam", lr=1e-6, clip_grad=1.0, use_distributed_optimizer=case.distopt
    )
    train = TrainConfig(
        max_tokens_per_micro_batch=tokens,
        recompute_granularity="full" if case.recompute else None,
    )
    dims = ParallelDims(tp=layout.tp, pp=layout.pp)
    return model_config(quick), optim, train, dims, layout, row


def worker(*, tp: int, pp: int, case_name: str, quick: bool) -> dict:
    import gc

    import torch

    from megatron_grpo.algo.batch import Sample
    from megatron_grpo.config import LossConfig
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train.step import StepSettings, train_on_rollout

    case = next(c for c in CASES if c.name == case_name)
    model_cfg, optim, train, dims, layout, row = configs(case, quick)
    ctx = init_parallel(dims)
    g = torch.Generator().manual_seed(0)
    samples = []
    rows_per_rank = train.max_tokens_per_micro_batch // row
    for i in range(rows_per_rank * layout.dp):
        tokens = torch.randint(1, model_cfg.vocab_size, (row,), generator=g)
        mask = torch.cat([torch.zeros(row // 4), torch.ones(row - row // 4)])
        samples.append(
            Sample(
                tokens=tokens,
                loss_mask=mask,
                advantage=float(torch.randn((), generator=g)),
                group=i // 2,
                sample_id=i,
                rollout_logprobs=-torch.rand(row, generator=g) * mask,
            )
        )
    settings = StepSettings(
        global_batch_size=len(samples),
        num_iterations=1,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
        pack=False,
        vocab_size=model_cfg.vocab_size,
        max_len=row,
    )
    loss_cfg = LossConfig(mode="token-mean")
    gc.collect()
    sampler = ResidentPeak()
    before = rss()
    model = build_model(model_cfg, ctx, optim=optim, train=train)
    optimizer, scheduler = build_optimizer(optim, model_cfg, model, ctx)
    built = rss()
    train_on_rollout(model, optimizer, scheduler, ctx, samples, loss_cfg, settings)
    gc.collect()
    at_rest = rss()
    sampler.reset()
    train_on_rollout(model, optimizer, scheduler, ctx, samples, loss_cfg, settings)
    peak = sampler.close()
    return {
        "rank": ctx.rank,
        "baseline": before,
        "built": built - before,
        "model_states": at_rest - before,
        "optimizer": at_rest - built,
        "peak": peak - before,
    }


def estimate(case: Case, quick: bool) -> dict[str, float]:
    """The dry run's figures for ``case`` (no reserve), bytes."""
    from megatron_grpo.commands.dry_run import dry_run
    from megatron_grpo.config import Config, LossConfig

    model_cfg, optim, train, dims, layout, _ = configs(case, quick)
    cfg = Config(
        model=model_cfg,
        parallel=dims,
        optim=optim,
        train=replace(train, global_batch_size=None),
        loss=LossConfig(mode="token-mean", kl_coef=0.0),
    )
    report = dry_run(cfg, world_size=layout.world_size, unfused_attention=True)
    w = report.worst
    states = w.weights + w.gradients + w.optimizer
    return {
        "model_states": states,
        "optimizer": w.optimizer,
        "peak": w.total - w.reserved,
        "activations": w.activations,
        "logits": w.logits,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--timeout", type=float, help="seconds per launch (default 1200)")
    args = p.parse_args()
    from megatron_grpo.commands.invariance import Layout

    results: dict[str, dict] = {}
    for case in CASES:
        ranks = run_at_layout(
            __file__,
            Layout.parse(case.layout),
            timeout=args.timeout or (300.0 if args.quick else 1200.0),
            env=MALLOC_ENV,
            case_name=case.name,
            quick=args.quick,
        )
        est = estimate(case, args.quick)
        worst = max(ranks, key=lambda r: r["peak"])
        results[case.name] = {
            "case": asdict(case),
            "measured_per_rank": ranks,
            "dry_run": est,
            "peak_measured_over_estimate": worst["peak"] / est["peak"],
        }
        print(
            f"{case.name:<24} peak {mib(worst['peak']):>8} (dry run {mib(est['peak']):>8}, "
            f"x{worst['peak'] / est['peak']:.2f}); model states {mib(worst['model_states'])} "
            f"(dry run {mib(est['model_states'])}); optimizer {mib(worst['optimizer'])} "
            f"(dry run {mib(est['optimizer'])})",
            flush=True,
        )
    ratios = {
        "optimizer_without_over_with_distopt": _ratio(results, "dp2", "dp2_distopt", "optimizer"),
        "peak_without_over_with_recompute_dp2": _ratio(results, "dp2", "dp2_recompute", "peak"),
        "peak_without_over_with_recompute_tp2": _ratio(
            results, "tp2_sp", "tp2_sp_recompute", "peak"
        ),
        "peak_without_over_with_distopt_dp2": _ratio(results, "dp2", "dp2_distopt", "peak"),
    }
    within = {
        name: abs(r["peak_measured_over_estimate"] - 1) <= TOLERANCE for name, r in results.items()
    }
    for name, value in ratios.items():
        print(f"RATIO {name}: {value:.3f}")
    print(
        f"dry run within {TOLERANCE:.0%} of the measured peak: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in within.items())
    )
    write_result(
        "memory",
        args.out,
        {
            "quick": args.quick,
            "model": asdict(model_config(args.quick)),
            "cases": results,
            "ratios": ratios,
            "dry_run_within_tolerance": within,
        },
    )


def _ratio(results: dict, num: str, den: str, key: str) -> float:
    def worst(name: str) -> int:
        return max(r[key] for r in results[name]["measured_per_rank"])

    return worst(num) / worst(den)


def mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


if __name__ == "__main__":
    main()
