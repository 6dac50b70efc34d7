"""Weight sync to the embedded server vs plain safetensors serialization of the same weights.

    python bench/weight_sync.py                 # TP2 learner (2 gloo processes), ~58 MB fp32
    python bench/weight_sync.py --layout 1x1x1
    python bench/weight_sync.py --quick

One push is what the trainer does after each step: every rank gathers the
full tensors from its shards (``full_state.gather_full_state``), global rank
0 maps them to Hugging Face names (``convert.weights.megatron_to_hf``) and sends
them with ``weight_sync.push(method="tensor")`` to the embedded server on the
same machine: pause, flush, safetensors + base64 serialization, HTTP, decoding
and copying into the server's model, continue. The baseline, timed in the
same repeats in rotating order, is ``safetensors.torch.save`` of the same
HF-named state dict to bytes in memory. Reported: push / safetensors time
ratio, push MB/s, and the push split into gather, mapping and the rest.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from _common import (
    Ratio,
    Timing,
    interleaved,
    parser,
    ratios,
    run_at_layout,
    seconds,
    sum_over_ranks,
    summary,
    tiny_model,
    write_result,
)


def model_config(quick: bool):
    from megatron_grpo.config import ModelConfig

    if quick:
        return tiny_model(
            vocab_size=500,
            make_vocab_size_divisible_by=8,
            max_position_embeddings=128,
            qk_layernorm=True,
        )
    return ModelConfig(
        num_layers=2,
        hidden_size=512,
        ffn_hidden_size=1536,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=8000,
        make_vocab_size_divisible_by=128,
        max_position_embeddings=512,
        qk_layernorm=True,
    )


def worker(*, tp: int, pp: int, model_cfg, family: str, repeats: int, warmup: int) -> dict | None:
    import safetensors.torch

    from megatron_grpo.config import ParallelDims
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout import weight_sync
    from megatron_grpo.rollout.embedded.weights import tensor_update

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx, wrap_ddp=False)
    main = ctx.is_main
    served = _start_server(model_cfg, family) if main else None
    reference = weight_sync.hf_state(model, ctx, model_cfg, family)  # for the baseline
    parts: dict[str, list[Timing]] = {"gather": [], "mapping": [], "rest": []}
    push = _push_action(model, ctx, model_cfg, family, served, parts)

    plain = None
    if main:
        plain = {k: v.detach().contiguous() for k, v in reference.items()}

    def on_main(fn):
        return lambda: fn() if main else None

    times = interleaved(
        {
            "push": push,
            "safetensors": on_main(lambda: safetensors.torch.save(plain)),
            "serialize_only": on_main(lambda: tensor_update(plain, weight_version="x")),
        },
        repeats=repeats,
        warmup=warmup,
    )
    skip = len(parts["gather"]) - len(times["push"])
    times.update({f"push_{k}": v[skip:] for k, v in parts.items()})
    times = sum_over_ranks(times)
    if not main:
        return None
    max_diff = _served_max_diff(served, plain)
    return {
        "times": times,
        "bytes": sum(t.numel() * t.element_size() for t in plain.values()),
        "num_tensors": len(plain),
        "server_max_abs_diff": max_diff,
    }


def _start_server(model_cfg, family: str):
    """On the main rank: the embedded server on a HF model of the same shape, and a client."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from megatron_grpo.convert.hf_config import hf_config_from_model_config
    from megatron_grpo.rollout.client import ClientConfig, SGLangClient
    from megatron_grpo.rollout.embedded.server import start_embedded_server

    hf = AutoModelForCausalLM.from_config(hf_config_from_model_config(model_cfg, family))
    server = start_embedded_server(hf, weight_version="0", max_batch_size=1)
    loop = asyncio.new_event_loop()
    client = SGLangClient(ClientConfig(urls=(server.url,)))
    loop.run_until_complete(client.__aenter__())
    return server, loop, client


def _push_action(model, ctx, model_cfg, family: str, served, parts: dict[str, list[Timing]]):
    """One push as the trainer does it, its gather / mapping / rest times added to ``parts``."""
    import torch.distributed as dist

    from megatron_grpo.convert.weights import megatron_to_hf
    from megatron_grpo.mcore.full_state import gather_full_state
    from megatron_grpo.rollout import weight_sync

    version = iter(range(1, 1 << 30))

    def push() -> None:
        dist.barrier()
        clocks = [_clocks()]
        full = gather_full_state(model, ctx, vocab_size=model_cfg.vocab_size)
        clocks.append(_clocks())
        if served is not None:
            _, loop, client = served
            named = megatron_to_hf(full, model_cfg, family)
            clocks.append(_clocks())
            loop.run_until_complete(
                weight_sync.push(client, named, method="tensor", weight_version=str(next(version)))
            )
        else:
            clocks.append(_clocks())
        dist.barrier()
        clocks.append(_clocks())
        for key, (a, b) in zip(parts, zip(clocks, clocks[1:])):
            parts[key].append(Timing(b[0] - a[0], b[1] - a[1]))

    return push


def _served_max_diff(served, plain: dict) -> float:
    """Stop the server; the largest difference between its weights and the learner's."""
    import torch

    server, loop, client = served
    with torch.no_grad():  # the server holds exactly what the learner has
        state = server.engine.model.state_dict()
        max_diff = max(float((state[k].float() - v.float()).abs().max()) for k, v in plain.items())
    loop.run_until_complete(client.close())
    loop.close()
    server.stop()
    return max_diff


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layout", help="DPxTPxPP of the learner (default 1x2x1; 1x1x1 with --quick)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument(
        "--timeout", type=float, help="seconds per launch (default 600; 150 with --quick)"
    )
    args = p.parse_args()

    from megatron_grpo.commands.invariance import Layout

    layout = Layout.parse(args.layout or ("1x1x1" if args.quick else "1x2x1"))
    repeats = args.repeats or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    model_cfg = model_config(args.quick)
    family = "qwen3"
    out = run_at_layout(
        __file__,
        layout,
        timeout=args.timeout or (150.0 if args.quick else 600.0),
        model_cfg=model_cfg,
        family=family,
        repeats=repeats,
        warmup=warmup,
    )[0]
    times = out["times"]
    mb = out["bytes"] / 1e6
    ratio = {
        clock: Ratio.of(
            f"{layout} push/safetensors_save [{clock}]",
            ratios(times, ["push"], "safetensors", clock),
        )
        for clock in ("cpu", "wall")
    }
    for r in ratio.values():
        print(r.line())
    mb_per_s = [mb / t.wall for t in times["push"]]
    print(
        f"  {mb:.1f} MB in {out['num_tensors']} tensors: push "
        f"{summary(mb_per_s)['median']:.0f} MB/s median (wall), safetensors "
        f"{mb / summary([t.wall for t in times['safetensors']])['median']:.0f} MB/s; "
        f"server weights equal the learner's (max |diff| {out['server_max_abs_diff']:.1e})"
    )
    shares = {
        k: Ratio.of(f"{layout} {k}/push [cpu]", ratios(times, [k], "push", "cpu"))
        for k in ("push_gather", "push_mapping", "push_rest", "serialize_only")
    }
    for r in shares.values():
        print("  " + r.line())
    write_result(
        "weight_sync",
        args.out,
        {
            "quick": args.quick,
            "layout": str(layout),
            "family": family,
            "model": asdict(model_cfg),
            "megabytes": mb,
            "push_vs_safetensors": ratio,
            "push_mb_per_s_wall": summary(mb_per_s),
            "push_shares": shares,
            "seconds": seconds(times),
            "server_max_abs_diff": out["server_max_abs_diff"],
            "repeats": repeats,
        },
    )


if __name__ == "__main__":
    main()
