"""Weight push to the embedded server: against a plain safetensors save, delta against full
after one RL step, and measured against the dry run's predicted push time.

    python bench/weight_sync.py                 # DP2 x TP2 x PP2 (8 gloo processes), ~650 MB
    python bench/weight_sync.py --layout 1x2x2
    python bench/weight_sync.py --quick
    python bench/weight_sync.py --delta         # delta vs full pushes after one RL step
    python bench/weight_sync.py --delta --body  # full pushes as an engine on another host gets them
    python bench/weight_sync.py --sizes         # measured vs predicted push time, three sizes

One push is what the trainer does after each step (``weight_sync.push.WeightPush``,
``rollout.sync.method=tensor``): every pipeline stage's sender gathers its layers over TP, a layer
at a time, maps them to Hugging Face names and streams safetensors buckets to the embedded
server, which runs in a process of its own (``python -m megatron_grpo.embedded``);
the other DP replica's ranks only take part in nothing but the parameter check. The
baseline, timed in the same repeats in rotating order, is ``safetensors.torch.save`` of the
same HF-named state dict to bytes in memory, on one process.

Reported: push / save wall-time ratio; push / save CPU-time ratio with the CPU of every
learner rank and of the server process counted; push MB/s; and each rank's peak resident
memory growth during a push (sampled every millisecond, glibc told to return freed memory),
against ``memory_model.weight_push_bytes``. The last push is read back from the server
(``rollout.sync.check``).

``--delta`` (``rollout.sync.delta``): the CPU demo (``examples/cpu_demo/grpo.yaml``, two
processes) trains one RL step from its warmed-up model and exports the result
(``train.save_hf_interval``); the weights before and after that step are then pushed, in turn,
by a stage's sender (``StageSender``) to two embedded servers (in this process, on threads of
their own), one fed full pushes and one deltas, in alternating order, each push after the
first a delta of one RL step. Per dtype sent (fp32, the trainer's; bf16, the same weights
cast): bytes of tensor data a delta push sends / a full push's, and delta / full push time
(wall and CPU, the servers' included). Full pushes go through shared memory, as to an
engine on the same host; with ``--body`` as a safetensors request body, as to one on another.

``--sizes``: one stage (layout 1x1x1) pushes models of three sizes; the measured push time
(wall median) is printed beside ``commands.push_time.predict_push``'s for the same model and
settings, and their ratio.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

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

from megatron_grpo.commands.push_time import CALIBRATION_SIZES, calibration_model
from megatron_grpo.testing.memory import MALLOC_ENV, ResidentPeak

BUCKET_MB = 64


def model_config(quick: bool, size: str = "default"):
    if quick:
        return tiny_model(vocab_size=500, make_vocab_size_divisible_by=8, qk_layernorm=True)
    return calibration_model(size)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(*, tp: int, pp: int, model_cfg, url: str, server_pid: int, repeats: int, warmup: int):
    import ctypes
    import gc

    import safetensors.torch
    import torch.distributed as dist

    from megatron_grpo.commands.memory_model import weight_push_bytes
    from megatron_grpo.config import EnginesConfig, ParallelDims, RolloutConfig, WeightSyncConfig
    from megatron_grpo.convert.weights import megatron_to_hf
    from megatron_grpo.mcore.full_state import gather_full_state
    from megatron_grpo.mcore.model import build_model
    from megatron_grpo.mcore.parallel import init_parallel
    from megatron_grpo.rollout.runtime import RolloutRuntime
    from megatron_grpo.weight_sync.push import WeightPush

    ctx = init_parallel(ParallelDims(tp=tp, pp=pp))
    model = build_model(model_cfg, ctx, wrap_ddp=False)
    rollout = RolloutConfig(
        engines=EnginesConfig(type="sglang", urls=[url]), sync=WeightSyncConfig(bucket_mb=BUCKET_MB)
    )
    runtime = RolloutRuntime(rollout, model_cfg=model_cfg) if ctx.is_main else None
    push = WeightPush(model_cfg, rollout, ctx)
    version = iter(range(1 << 30))

    def push_once() -> None:
        dist.barrier()
        push(model, str(next(version)), runtime)
        dist.barrier()

    push_once()  # connections open, imports done
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak = ResidentPeak()
    push_once()
    growth = peak.growth()
    shard = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    # The baseline's tensors: the whole model on rank 0, gathered only now.
    full = gather_full_state(model, ctx, vocab_size=model_cfg.vocab_size)
    plain = None if full is None else megatron_to_hf(full, model_cfg, "qwen3")
    server_cpu: list[float] = []

    def timed_push() -> None:
        before = _cpu_s(server_pid) if ctx.is_main else 0.0
        push_once()
        if ctx.is_main:
            server_cpu.append(_cpu_s(server_pid) - before)

    times = interleaved(
        {
            "push": timed_push,
            "safetensors": lambda: safetensors.torch.save(plain) if plain is not None else None,
        },
        repeats=repeats,
        warmup=warmup,
    )
    memory = [None] * ctx.world_size
    dist.all_gather_object(memory, {"growth": growth, "shard": shard, "tp": tp, "pp": pp})
    rollout.sync.check = True
    push_once()  # read back from the server: it holds what the learner has
    times = sum_over_ranks(times)
    push.close()
    if runtime is not None:
        runtime.close()
    if plain is None or times is None:
        return None
    server = server_cpu[warmup:]
    times["push_with_server"] = [
        Timing(t.wall, t.cpu + s) for t, s in zip(times["push"], server, strict=True)
    ]
    return {
        "times": times,
        "bytes": sum(t.numel() * t.element_size() for t in plain.values()),
        "num_tensors": len(plain),
        "memory": memory,
        "bound": weight_push_bytes(model_cfg, BUCKET_MB << 20),
    }


def start_server(model_cfg, directory: Path) -> tuple[subprocess.Popen, str]:
    """The embedded server in its own process, on a random HF model of the same shape."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.convert.hf_config import hf_config_from_model_config
    from megatron_grpo.launch import free_port
    from megatron_grpo.rollout.servers import http_ok

    AutoModelForCausalLM.from_config(
        hf_config_from_model_config(model_cfg, "qwen3")
    ).save_pretrained(directory)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_grpo.embedded", "--model-path", str(directory)]
        + ["--port", str(port), "--max-batch-size", "1"],
        env={**os.environ, **MALLOC_ENV},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not http_ok(f"{url}/health", timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the embedded server did not start")
        time.sleep(0.2)
    return proc, url


def report(out: dict, layout) -> dict:
    times = out["times"]
    mb = out["bytes"] / 1e6
    ratio = {
        "wall": Ratio.of(
            f"{layout} push/safetensors_save [wall]", ratios(times, ["push"], "safetensors", "wall")
        ),
        "cpu": Ratio.of(
            f"{layout} push/safetensors_save [cpu, all learner ranks + server]",
            ratios(times, ["push_with_server"], "safetensors", "cpu"),
        ),
    }
    for r in ratio.values():
        print(r.line())
    mb_per_s = [mb / t.wall for t in times["push"]]
    print(
        f"  {mb:.1f} MB in {out['num_tensors']} tensors: push "
        f"{summary(mb_per_s)['median']:.0f} MB/s median (wall), safetensors save "
        f"{mb / summary([t.wall for t in times['safetensors']])['median']:.0f} MB/s"
    )
    bound = out["bound"] / 2**20
    for rank, m in enumerate(out["memory"]):
        print(
            f"  rank {rank}: resident set grew {m['growth'] / 2**20:.1f} MiB during a push "
            f"(own shard {m['shard'] / 2**20:.0f} MiB; stated bound for a sender {bound:.1f} MiB)"
        )
    return {"push_vs_safetensors": ratio, "push_mb_per_s_wall": summary(mb_per_s), "mb": mb}


def measure_push(model_cfg, layout, *, repeats: int, warmup: int, timeout: float) -> dict:
    """``worker`` on every rank of ``layout``, with the embedded server in its own process."""
    with tempfile.TemporaryDirectory(prefix="mgrpo_bench_sync_") as tmp:
        server, url = start_server(model_cfg, Path(tmp) / "hf")
        try:
            return run_at_layout(
                __file__,
                layout,
                timeout=timeout,
                env=MALLOC_ENV,
                model_cfg=model_cfg,
                url=url,
                server_pid=server.pid,
                repeats=repeats,
                warmup=warmup,
            )[0]
        finally:
            server.terminate()
            server.wait(timeout=60)


# --------------------------------------------------------------------------- push vs save


def push_vs_save(args) -> None:
    from megatron_grpo.commands.invariance import Layout

    layout = Layout.parse(args.layout or ("1x1x2" if args.quick else "2x2x2"))
    repeats = args.repeats or (2 if args.quick else 6)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    model_cfg = model_config(args.quick)
    out = measure_push(
        model_cfg, layout, repeats=repeats, warmup=warmup, timeout=args.timeout or 900.0
    )
    summary_ = report(out, layout)
    write_result(
        "weight_sync",
        args.out,
        {
            "quick": args.quick,
            "layout": str(layout),
            "model": asdict(model_cfg),
            "megabytes": summary_["mb"],
            "push_vs_safetensors": summary_["push_vs_safetensors"],
            "push_mb_per_s_wall": summary_["push_mb_per_s_wall"],
            "memory_per_rank": out["memory"],
            "sender_bound_bytes": out["bound"],
            "seconds": seconds(out["times"]),
            "repeats": repeats,
        },
    )


# --------------------------------------------------------------------------- --sizes


def measured_vs_predicted(args) -> None:
    """One stage's push at three sizes, against ``commands.push_time.predict_push``."""
    from megatron_grpo.commands.invariance import Layout
    from megatron_grpo.commands.push_time import predict_push
    from megatron_grpo.config import ParallelDims

    layout = Layout.parse("1x1x1")
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    sizes = ["small"] if args.quick else list(CALIBRATION_SIZES)
    rows = {}
    for size in sizes:
        model_cfg = model_config(False, size)
        out = measure_push(
            model_cfg, layout, repeats=repeats, warmup=warmup, timeout=args.timeout or 900.0
        )
        walls = [t.wall for t in out["times"]["push"]]
        predicted = predict_push(
            model_cfg, ParallelDims(), method="tensor", bucket_mb=BUCKET_MB, engine_type="embedded"
        ).seconds
        ratio = Ratio.of(
            f"{size} ({out['bytes'] / 1e6:.1f} MB) measured/predicted push",
            [w / predicted for w in walls],
        )
        print(ratio.line())
        print(
            f"  {size}: {out['num_tensors']} tensors, measured {summary(walls)['median']:.3f} s "
            f"(wall median), predicted {predicted:.3f} s"
        )
        rows[size] = {
            "megabytes": out["bytes"] / 1e6,
            "num_tensors": out["num_tensors"],
            "measured_wall_s": summary(walls),
            "measured_cpu_s": summary([t.cpu for t in out["times"]["push_with_server"]]),
            "predicted_s": predicted,
            "measured_over_predicted": ratio,
        }
    write_result(
        "weight_sync_sizes",
        args.out,
        {"quick": args.quick, "layout": str(layout), "repeats": repeats, "sizes": rows},
    )


# --------------------------------------------------------------------------- --delta


def delta_vs_full(args) -> None:
    """Delta and full pushes of the CPU demo's weights before and after one RL step."""
    import torch
    from _delta_push import compare, hf_weights, rl_step
    from transformers import AutoConfig

    if args.body:
        from megatron_grpo.embedded import weights

        weights.shared_memory_available = lambda: False  # type: ignore[assignment]
    repeats = args.repeats or (2 if args.quick else 8)
    with tempfile.TemporaryDirectory(prefix="mgrpo_bench_delta_") as tmp:
        before, after = rl_step(Path(args.assets), Path(tmp) / "run")
        models = [hf_weights(before), hf_weights(after)]
        config = AutoConfig.from_pretrained(before)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = compare(config, models, dtype, repeats)
        for key in ("bytes", "wall", "cpu"):
            print(out[key].line())
        print(
            f"  {out['bytes_full'] / 1e6:.3f} MB full; push wall median full "
            f"{out['full_wall_s']['median'] * 1e3:.1f} ms, "
            f"delta {out['delta_wall_s']['median'] * 1e3:.1f} ms"
        )
        results[str(dtype).removeprefix("torch.")] = out
    write_result(
        "weight_sync_delta",
        args.out,
        {"quick": args.quick, "body": args.body, "repeats": repeats, **results},
    )


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layout", help="DPxTPxPP of the learner (default 2x2x2; 1x1x2 with --quick)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--timeout", type=float, help="seconds per launch (default 900)")
    p.add_argument("--delta", action="store_true", help="delta vs full pushes after an RL step")
    p.add_argument("--body", action="store_true", help="--delta: full pushes as a request body")
    p.add_argument(
        "--assets", default="runs/cpu_demo/assets", help="--delta: the CPU demo's assets"
    )
    p.add_argument("--sizes", action="store_true", help="measured vs predicted push time")
    args = p.parse_args()
    if args.delta:
        delta_vs_full(args)
    elif args.sizes:
        measured_vs_predicted(args)
    else:
        push_vs_save(args)


if __name__ == "__main__":
    main()
