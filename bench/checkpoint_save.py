"""Checkpoint save time: written in-process vs megatron-core's own writer processes.

    python bench/checkpoint_save.py                  # TP2 on gloo; a tiny and a medium model
    python bench/checkpoint_save.py --repeats 10
    python bench/checkpoint_save.py --quick          # smoke test

A rank with under ``checkpoint.IN_PROCESS_BYTES`` of tensors writes its checkpoint files
itself (``mcore.compat.writes_in_process``); above that, megatron-core's ``torch_dist``
strategy as it ships: one forked process per file, and the results through the queue of a
``spawn``-ed multiprocessing Manager that lives on after the first save. Per model, one
multi-process run builds the model and its Adam state and then, in each repeat and in
rotating order, saves the trainer's checkpoint (``train.state.save``: model, optimizer, RNG,
an atomic rename) both ways into a fresh directory:
- ``in_process``: the way the trainer saves it;
- ``stock``: megatron-core's writer (``IN_PROCESS_BYTES`` set to 0 for the run).

Reported per model: the ratio in_process / stock (wall and CPU time; CPU summed over the
ranks, the helper processes' CPU not included, so the CPU ratio flatters ``stock``), the
median seconds of each, the first save of each (the Manager's start is in the first
``stock`` one), and the helper processes a rank has left after the ``stock`` saves with
their resident memory.
"""

from __future__ import annotations

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

SIZES = ("tiny", "medium")


def model_config(size: str):
    from megatron_grpo.config import ModelConfig

    if size == "tiny":
        return tiny_model(vocab_size=512)
    # The loss-overhead benchmark's Qwen-like model: ~12M parameters, ~140 MB with Adam.
    return ModelConfig(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=768,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=16000,
    )


def worker(tp: int, pp: int, size: str, repeats: int, warmup: int, out_dir: str) -> dict | None:
    import itertools
    import os
    import shutil
    from pathlib import Path

    import psutil
    import torch.distributed as dist
    from _common import measure

    from megatron_grpo.config import OptimConfig, ParallelDims
    from megatron_grpo.mcore import checkpoint
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.optim import build_optimizer
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.train import state

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    cfg = model_config(size)
    optim = OptimConfig()
    model = build_model(cfg, ctx, optim=optim)
    optimizer, scheduler = build_optimizer(optim, cfg, model, ctx)
    optimizer.step()  # zero gradients: Adam's state tensors exist, as after a real step
    in_process_bytes = checkpoint.IN_PROCESS_BYTES
    counter = itertools.count()

    def save(limit: int):
        def run():
            checkpoint.IN_PROCESS_BYTES = limit
            step = next(counter)
            dist.barrier()
            state.save(
                out_dir,
                step,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                ctx=ctx,
                extra={},
                keep_last=1,
            )
            dist.barrier()

        return run

    actions = {"in_process": save(in_process_bytes), "stock": save(0)}
    first = {name: measure(action) for name, action in actions.items()}
    times = interleaved(actions, repeats=repeats, warmup=warmup)
    helpers = psutil.Process(os.getpid()).children(recursive=True)
    helper_mb = sum(p.memory_info().rss for p in helpers) / 2**20
    checkpoint_mb = _checkpoint_mb(model, optimizer, ctx)  # collective
    summed = sum_over_ranks(times)
    if ctx.is_main:
        shutil.rmtree(Path(out_dir), ignore_errors=True)
    if summed is None:
        return None
    return {
        "times": summed,
        "first_save_s": {name: t.wall for name, t in first.items()},
        "rank0_helper_processes_after_stock": len(helpers),
        "rank0_helper_rss_mb": round(helper_mb, 1),
        "checkpoint_mb": round(checkpoint_mb, 1),
    }


def _checkpoint_mb(model, optimizer, ctx) -> float:
    """MB of tensors in the checkpoint (summed over ranks)."""
    import torch
    import torch.distributed as dist

    from megatron_grpo.mcore.checkpoint import local_bytes
    from megatron_grpo.train.state import _sharded_state

    total = torch.tensor(
        float(local_bytes(_sharded_state(model, optimizer, ctx, is_loading=False)))
    )
    dist.all_reduce(total)
    return float(total) / 2**20


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layout", default="1x2x1", help="DPxTPxPP (default 1x2x1)")
    p.add_argument("--repeats", type=int, help="timed saves of each kind per model (default 7)")
    p.add_argument("--sizes", help=f"comma-separated, of {','.join(SIZES)}")
    args = p.parse_args()
    import tempfile

    from megatron_grpo.commands.invariance import Layout

    layout = Layout.parse(args.layout)
    repeats = args.repeats or (2 if args.quick else 7)
    sizes = (args.sizes or ("tiny" if args.quick else ",".join(SIZES))).split(",")
    results = {}
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
            (out,) = [
                r
                for r in run_at_layout(
                    __file__,
                    layout,
                    timeout=900,
                    size=size,
                    repeats=repeats,
                    warmup=1,
                    out_dir=tmp,
                )
                if r is not None
            ]
        times = out.pop("times")
        by_clock = {
            clock: Ratio.of(
                f"{size} in_process/stock save ({clock})",
                ratios(times, ["in_process"], "stock", clock),
            )
            for clock in ("wall", "cpu")
        }
        for ratio in by_clock.values():
            print(ratio.line())
        secs = seconds(times)
        median = {name: secs[name]["wall"]["median"] for name in ("in_process", "stock")}
        first = out["first_save_s"]
        print(
            f"  {size} ({out['checkpoint_mb']} MB): median save in_process "
            f"{median['in_process']:.3f} s, stock {median['stock']:.3f} s; first save "
            f"in_process {first['in_process']:.3f} s, stock {first['stock']:.3f} s; rank 0 keeps "
            f"{out['rank0_helper_processes_after_stock']} helper processes "
            f"({out['rank0_helper_rss_mb']} MB resident) after the stock saves"
        )
        results[size] = {"ratios": by_clock, "seconds": secs, **out}
    write_result(
        "checkpoint_save",
        args.out,
        {"quick": args.quick, "layout": args.layout, "repeats": repeats, "models": results},
    )


if __name__ == "__main__":
    main()
