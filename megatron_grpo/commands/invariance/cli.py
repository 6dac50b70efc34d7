"""``megatron-grpo check-invariance``: its arguments and what it prints."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DEFAULT_LAYOUTS = "1x1x1,2x1x1,1x2x1,1x1x2,2x2x1,2x1x2,1x2x2"
MOE_LAYOUTS = "1x1x1x1,2x1x1x2,1x2x1x2,2x1x2x2"


def add_parser(sub, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    from megatron_grpo.commands.invariance.features import BF16_TOLERANCE, FEATURES, TF32_TOLERANCE

    p = sub.add_parser(
        "check-invariance",
        help="prove the gradient of one global batch is the same at every layout",
        description="Train one fixed global batch with the trainer's own step function "
        "(its planner, frozen old and reference log-probs, two optimizer passes) at each "
        "DPxTPxPP[xEP[xCP]] layout (multi-process gloo on CPU, nccl on GPU), with several "
        "micro-batch "
        "counts, a permutation of samples, packing, a DP rank without loss tokens and prompt "
        "groups scattered over DP ranks, and compare gradients, updates, grad "
        "norms and replicas of each pass against the single-process run; that run is "
        "compared with the gradient computed by transformers and the loss from its "
        "definition. Features: " + "; ".join(f"{name}: {text}" for name, text in FEATURES.items()),
    )
    add_config_args(p)
    p.add_argument("--mode", default="token-mean", help="loss aggregation mode, or 'all'")
    p.add_argument(
        "--model",
        choices=("dense", "moe"),
        default="dense",
        help="the tiny model: dense (Llama-style), or moe (Qwen3-MoE, 4 experts top-2, the "
        "routers' balance loss on); --set model.* overrides either",
    )
    p.add_argument(
        "--layouts",
        help=f"comma-separated DPxTPxPP, DPxTPxPPxEP or DPxTPxPPxEPxCP (default "
        f"{DEFAULT_LAYOUTS}; with --model moe {MOE_LAYOUTS}); CP > 1 needs Transformer Engine "
        "(a GPU), e.g. 1x1x1x1x2",
    )
    p.add_argument(
        "--micro-batches",
        default="1,3",
        help="comma-separated micro-batch counts per rank to aim at: each sets the token "
        "budget the trainer's planner splits the batch under",
    )
    p.add_argument(
        "--features",
        default="",
        help=f"comma-separated, switched on where the layout allows: {', '.join(FEATURES)}",
    )
    p.add_argument(
        "--no-permute",
        dest="permute",
        action="store_false",
        help="skip the permutation of samples across ranks and micro-batches",
    )
    p.add_argument(
        "--no-pack",
        dest="pack",
        action="store_false",
        help="skip the case with samples packed into one row per micro-batch",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help=f"largest max|delta|/max|g| (default 1e-5; {BF16_TOLERANCE:g} with bf16; "
        f"{TF32_TOLERANCE:g} where Transformer Engine runs in float32: its GEMMs use TF32)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per layout launch")
    p.set_defaults(func=run)


def _model_config(args: argparse.Namespace):
    """The tiny model of ``--model`` with the ``model.*`` overrides; None: the default."""
    from megatron_grpo.commands.invariance.cases import default_moe_model
    from megatron_grpo.config import ModelConfig, apply_override, from_dict, load_config, to_dict

    if args.model == "dense":
        return (
            load_config(args.config, args.overrides).model
            if args.config or args.overrides
            else None
        )
    if args.config:
        raise ValueError("--model moe takes model.* overrides with --set, not --config")
    raw = {"model": to_dict(default_moe_model())}
    for item in args.overrides or []:
        apply_override(raw, item)
    return from_dict(ModelConfig, raw["model"])


def run(args: argparse.Namespace) -> int:
    from megatron_grpo.commands.invariance import (
        BF16_TOLERANCE,
        REFERENCE,
        TF32_TOLERANCE,
        Layout,
        check,
        parse_features,
    )
    from megatron_grpo.config import MODES, check_mode
    from megatron_grpo.mcore.layers import have_transformer_engine

    modes = list(MODES) if args.mode == "all" else [args.mode]
    for mode in modes:
        check_mode(mode)
    default_layouts = MOE_LAYOUTS if args.model == "moe" else DEFAULT_LAYOUTS
    layouts = [Layout.parse(x) for x in (args.layouts or default_layouts).split(",") if x.strip()]
    counts = [int(x) for x in args.micro_batches.split(",")]
    if any(c < 1 for c in counts):
        raise ValueError(f"--micro-batches must be positive integers, got {args.micro_batches}")
    features = parse_features(args.features)
    fp32 = TF32_TOLERANCE if have_transformer_engine() else 1e-5  # TE's fp32 GEMMs are TF32
    tolerance = args.tolerance or (BF16_TOLERANCE if "bf16" in features else fp32)
    model_cfg = _model_config(args)
    print(
        f"check-invariance: modes {', '.join(modes)}; layouts (DPxTPxPP[xEP[xCP]]) "
        f"{', '.join(map(str, layouts))}; micro-batches {counts}; features "
        f"{', '.join(features) or 'none'}; permutation {'on' if args.permute else 'off'}; "
        f"packing {'on' if args.pack else 'off'}; tolerance {tolerance:g}"
    )
    errors = check(
        layouts,
        modes=modes,
        micro_batch_counts=counts,
        permute=args.permute,
        pack=args.pack,
        features=features,
        model_cfg=model_cfg,
        timeout=args.timeout,
    )
    # the comparison outside megatron-core is always fp32 against fp32 (TF32 under TE)
    limit = {REFERENCE: min(tolerance, fp32)}
    worst = max(max(v.values()) for cases in errors.values() for v in cases.values())
    failed = [
        f"{layout} {case}: {', '.join(f'{k} {v:.2e}' for k, v in e.items())}"
        for layout, cases in errors.items()
        for case, e in cases.items()
        if max(e.values()) > limit.get(layout, tolerance)
    ]
    for line in failed:
        print(f"  FAIL {line}")
    verdict = "FAIL" if failed else "PASS"
    print(f"{verdict}: worst max|delta|/max|g| = {worst:.2e} (tolerance {tolerance:g})")
    return 1 if failed else 0
