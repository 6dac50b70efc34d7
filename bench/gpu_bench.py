"""The GPU numbers: train-step MFU, SGLang generation tokens/s, learner -> SGLang weight sync.

    bash bench/gpu.sh [OUT]                  # what to run; calls this script
    python bench/gpu_bench.py --out OUT      # the same, without the outer time limit
    python bench/gpu_bench.py --tiny --out OUT   # tiny shapes, also on CPU: checks the code path

Without CUDA (and without ``--tiny``) it prints that no GPU is present, writes
a JSON saying so and exits 0. With a GPU it runs two parts, each in its own
process with a hard time limit (a hang or crash loses that part only; the GPU
memory of one is free before the next), and writes the JSON after each:

``mfu``: one process (world size 1, nccl), a Qwen3-shaped model of about 1B
parameters (28 layers, hidden 1536, 12 heads of 128, 4 KV groups, SwiGLU
4608, vocabulary 151936, tied embeddings, q/k norm) in bf16 with the
Transformer Engine layer spec when importable, megatron-core's optimizer
(Adam, fp32 master weights). The GRPO step of ``bench/_workload.py`` (the
trainer's step: denominators, ``grpo_loss`` with KL, entropy and truncated IS,
optimizer) runs on a synthetic rollout batch under a token budget per
micro-batch, unpacked (the trainer's default with Transformer Engine),
interleaved with the plain cross-entropy step and the old-logprob pass as in
``bench/loss_overhead.py``. MFU = (6 N + 6 L d s) tokens/s / peak, with N
the parameters in matmuls (the output layer included, the embedding lookup
not), L layers, d = heads x head_dim, s each sample's own length (causal
attention, FLOPs of real tokens only; padding is waste, not work). Peak bf16
dense FLOP/s from the device name (H100 SXM and H200: 989 TFLOP/s) or
``--peak-tflops``.

``sglang``: a random Qwen3-shaped model (Qwen3-0.6B's shape) saved with
transformers, ``python -m sglang.launch_server`` on it (``SGLANG_PYTHON``, by
default this interpreter; "sglang not installed" when it cannot import
sglang), generation through the trainer's ``SGLangClient`` (n samples per
prompt, fixed length) against one direct batched ``/generate`` of the same work,
then the weights of a megatron learner holding the same model pushed as the
trainer pushes them (``WeightPush``, ``tensor``: CUDA IPC with a GPU, shared
memory without) against one request holding every tensor (``_gpu_sglang``). The
``distributed`` method is not measured here: NCCL refuses two ranks on one GPU.

The JSON carries the date and the device; ``bench/gpu_report.py`` writes it into
docs/benchmarks.md (bench/gpu.sh calls it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCH_DIR, Ratio, interleaved, machine, parser, ratios, seconds, tiny_model
from _gpu_sglang import part_sglang

PART_TIMEOUT_S = {"mfu": 200.0, "sglang": 250.0}
"""Per-part limits: 450 s, under gpu.sh's 470 s for this script, which with the set-up
(cached: 90 s) and the report keeps bench/gpu.sh within 600 s on one H100/H200."""
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


# --------------------------------------------------------------------------- part: mfu


def mfu_model(tiny: bool):
    from megatron_grpo.config import ModelConfig

    if tiny:
        return tiny_model(
            vocab_size=512, max_position_embeddings=512, qk_layernorm=True, tie_embeddings=True
        )
    return ModelConfig(
        num_layers=28,
        hidden_size=1536,
        ffn_hidden_size=4608,
        num_attention_heads=12,
        num_query_groups=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=8192,
        rotary_base=1000000.0,
        qk_layernorm=True,
        tie_embeddings=True,
        params_dtype="bfloat16",
    )


def attention_dim(cfg) -> int:
    """Query channels per layer: heads x head_dim."""
    return cfg.num_attention_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)


def matmul_params(cfg) -> int:
    """Parameters that take part in matmuls: every layer's, plus the output layer."""
    d = attention_dim(cfg)
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * (d // cfg.num_attention_heads)
    attention = cfg.hidden_size * (d + 2 * kv) + d * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    return cfg.num_layers * (attention + mlp) + cfg.vocab_size * cfg.hidden_size


def model_flops(cfg, samples) -> int:
    """6 N per token, plus causal attention over each sample's own length."""
    tokens = sum(len(s) for s in samples)
    return 6 * matmul_params(cfg) * tokens + sum(
        6 * cfg.num_layers * attention_dim(cfg) * len(s) ** 2 for s in samples
    )


def mfu_batch_shape(args):
    from _workload import BatchShape

    return BatchShape(
        num_samples=16 if args.tiny else args.samples,
        group_size=8,
        prompt_len=(8, 32) if args.tiny else (128, 512),
        completion_len=(8, 64) if args.tiny else (256, 1536),
        max_tokens_per_micro_batch=256 if args.tiny else args.tokens_per_micro_batch,
        pack=False,
    )


def part_mfu(args) -> dict[str, Any]:
    cfg = mfu_model(args.tiny)
    shape = mfu_batch_shape(args)
    t_start = time.perf_counter()
    steps, samples = _mfu_steps(cfg, shape)
    setup_s = time.perf_counter() - t_start
    times = _time_steps(steps, repeats=args.repeats)
    return _mfu_result(
        cfg, shape, steps.mbs, samples, times, peak_override=args.peak_tflops, setup_s=setup_s
    )


def _mfu_steps(cfg, shape):
    """The steps to time on one process, with the old and reference log-probs in place."""
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

    ctx = init_parallel(ParallelDims())
    model = build_model(cfg, ctx)
    optimizer, scheduler = build_optimizer(OptimConfig(optimizer="adam", lr=1e-6), cfg, model, ctx)
    samples = make_samples(shape, cfg.vocab_size)
    mbs = micro_batches(samples, shape, ctx, cfg.vocab_size)
    steps = Steps(
        model,
        optimizer,
        scheduler,
        ctx,
        mbs,
        model_cfg=cfg,
        loss_cfg=full_loss_config(),
        step_settings=settings(shape, cfg.vocab_size),
        total_loss_tokens=num_loss_tokens(samples),
    )
    steps.old_logprobs()
    add_reference_logprobs(mbs)
    return steps, samples


def _time_steps(steps, *, repeats: int):
    """The GRPO step, the cross-entropy step and the old-logprob pass, interleaved."""
    import torch

    def synced(fn):
        def run() -> None:
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        return run

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return interleaved(
        {"grpo": synced(steps.grpo), "ce": synced(steps.ce), "old": synced(steps.old_logprobs)},
        repeats=repeats,
        warmup=1,
    )


def _mfu_result(
    cfg, shape, mbs, samples, times, *, peak_override: float | None, setup_s: float
) -> dict[str, Any]:
    import torch

    from megatron_grpo.mcore.layers import have_transformer_engine

    tokens = sum(len(s) for s in samples)
    flops = model_flops(cfg, samples)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = peak_tflops(name, peak_override)
    step_s = statistics.median(t.wall for t in times["grpo"])
    padded = sum(int(mb.tokens.numel()) for mb in mbs)
    return {
        "device": name,
        "transformer_engine": have_transformer_engine(),
        "model": {
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "params_dtype": cfg.params_dtype,
            "matmul_params": matmul_params(cfg),
        },
        "batch": {
            "samples": len(samples),
            "tokens": tokens,
            "padded_positions": padded,
            "micro_batches": len(mbs),
            "tokens_per_micro_batch_budget": shape.max_tokens_per_micro_batch,
        },
        "grpo_step_s_median": step_s,
        "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": flops / step_s / 1e12,
        "peak_bf16_tflops": peak,
        "mfu": flops / step_s / (peak * 1e12) if peak else None,
        "grpo_step/ce_step": Ratio.of(
            "grpo_step/ce_step [wall]", ratios(times, ["grpo"], "ce", "wall")
        ),
        "(grpo_step+old)/ce_step": Ratio.of(
            "(grpo_step+old_logprob_pass)/ce_step [wall]",
            ratios(times, ["grpo", "old"], "ce", "wall"),
        ),
        "seconds": seconds(times),
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
        "setup_s": setup_s,
    }


# --------------------------------------------------------------------------- driver


def run_part(name: str, args, work: Path) -> dict[str, Any]:
    """One part in its own process (and process group), killed at its time limit."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    argv = [sys.executable, __file__, "--part", name, "--out", str(out)]
    argv += ["--tiny"] if args.tiny else []
    argv += ["--repeats", str(args.repeats), f"--sglang-args={args.sglang_args}"]
    argv += ["--samples", str(args.samples)]
    argv += ["--tokens-per-micro-batch", str(args.tokens_per_micro_batch)]
    if args.peak_tflops:
        argv += ["--peak-tflops", str(args.peak_tflops)]
    t0 = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=PART_TIMEOUT_S[name])
        except subprocess.TimeoutExpired:
            code = None
            _stop(proc)
    seconds_ = time.perf_counter() - t0
    tail = log.read_text(errors="replace")[-3000:]
    if code == 0 and out.exists():
        return {**json.loads(out.read_text()), "part_s": seconds_}
    what = f"timed out after {PART_TIMEOUT_S[name]:.0f} s" if code is None else f"exit code {code}"
    return {"error": what, "part_s": seconds_, "log_tail": tail}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first (the part stops its SGLang server on the way out), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    from dataclasses import asdict, is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--tiny", action="store_true", help="tiny shapes; runs on CPU too")
    p.add_argument("--part", choices=sorted(PART_TIMEOUT_S), help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=64, help="samples per global batch (mfu)")
    p.add_argument(
        "--tokens-per-micro-batch",
        type=int,
        default=4096,
        help="token budget per micro-batch (mfu); the logits of 4096 tokens x 152k vocabulary "
        "and their fp32 copies in the loss stay well inside an 80 GB H100",
    )
    p.add_argument("--peak-tflops", type=float, help="peak bf16 dense TFLOP/s of the GPU")
    p.add_argument(
        "--sglang-args",
        default=os.environ.get("SGLANG_ARGS", "--mem-fraction-static 0.6"),
        help="extra sglang.launch_server arguments (env SGLANG_ARGS)",
    )
    args = p.parse_args()
    out = Path(args.out or BENCH_DIR / "results" / "gpu.json")
    if args.part:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally` blocks
        if args.part == "mfu":
            write(out, part_mfu(args))
        else:
            write(out, part_sglang(args, startup_timeout_s=PART_TIMEOUT_S["sglang"] - 60))
        return 0

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("no GPU present (torch.cuda.is_available() is False): nothing measured")
        write(out, {"bench": "gpu", "gpu": False, "reason": "no GPU present", "machine": machine()})
        print(f"wrote {out}")
        return 0
    result: dict[str, Any] = {
        "bench": "gpu",
        "gpu": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d"),
        "environment": environment(),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="mgrpo_gpu_bench_") as tmp:
        for name in PART_TIMEOUT_S:
            print(f"part {name} (limit {PART_TIMEOUT_S[name]:.0f} s) ...", flush=True)
            result[name] = run_part(name, args, Path(tmp))
            write(out, result)
            print(json.dumps(_headline(name, result[name])), flush=True)
    print(f"wrote {out}")
    return 0


def environment() -> dict[str, Any]:
    """The device and versions the figures come from (the report's header)."""
    import torch

    env: dict[str, Any] = {"torch": torch.__version__}
    if torch.cuda.is_available():
        env |= {
            "device": torch.cuda.get_device_name(0),
            "gpus": torch.cuda.device_count(),
            "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        }
    try:
        import transformer_engine

        env["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        env["transformer_engine"] = None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH_DIR
    )
    env["commit"] = commit.stdout.strip() or None
    return env


def _headline(name: str, part: dict[str, Any]) -> dict[str, Any]:
    if "error" in part:
        return {name: part["error"]}
    if name == "mfu":
        keys = ("device", "mfu", "tokens_per_s", "model_tflops_per_s", "grpo_step_s_median")
        return {k: part.get(k) for k in keys}
    if "sglang" in part:
        return {name: part["sglang"]}
    return {
        "generation_tokens_per_s": part["generation"]["tokens_per_s"],
        "client/direct": part["generation"]["client/direct"]["median"],
        "weight_sync_gb_per_s": part["weight_sync"]["gb_per_s"],
        "push/one_request": part["weight_sync"]["push/one_request"]["median"],
    }


if __name__ == "__main__":
    sys.exit(main())
