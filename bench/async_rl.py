"""Asynchronous RL (rollout.max_staleness=1) vs the synchronous loop, on the CPU demo.

    python bench/async_rl.py                  # 3 repeats x 30 steps of each mode
    python bench/async_rl.py --quick

Each run is ``megatron-grpo train`` itself (1 learner process), pinned to CPU core 0 with
``taskset``, while the rollout side is pinned to core 1: its engine, an embedded server in
a process of its own launched by the trainer (``rollout.engines.launch_command``), and with
staleness 1 the rollout producer's process (``rollout.producer_cpus``: HTTP client,
decoding, rewards, advantages) with its reward worker. The learner and the rollout side
each have one core, as they would have their own GPUs and hosts; in the synchronous loop
the rollout's client side runs in the trainer, on core 0, while the learner waits.
Training is sized to take about as long as the rollout side's step (``--iterations``
optimizer passes over each rollout). The modes run interleaved, in rotating order.

Reported: RL steps per second with staleness 1 / synchronous (target >= 1.4), and for each
mode the learner's idle fraction: the share of a step it spends waiting for its rollout
(``perf/time_rollout_s`` over the step's time). The first steps of each run (start-up,
the producer filling) are left out. Also the reward of both, to show they learn alike.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Ratio, parser, summary, write_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cpu_demo" / "grpo.yaml"
SKIP = 2
"""Steps of each run left out of the timing."""


def assets(workdir: Path, *, quick: bool) -> Path:
    """The CPU demo's model, tokenizer and prompts (examples/cpu_demo/prepare.py)."""
    out = workdir / "assets"
    argv = [sys.executable, str(ROOT / "examples" / "cpu_demo" / "prepare.py"), "--out", str(out)]
    if quick:  # a model barely warmed up: the smoke test times nothing
        argv += ["--warmup-steps", "1"]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return out


def run(out: Path, data: Path, *, staleness: int, steps: int, args) -> list[dict]:
    engine = (
        f"taskset -c 1 {shlex.quote(sys.executable)} -m megatron_grpo.embedded "
        "--model-path {model} --host {host} --port {port} "
        f"--max-batch-size {args.prompts * args.samples}"
    )
    overrides: dict[str, object] = {
        "output_dir": out,
        "tokenizer": data / "model",
        "train.init": data / "model",
        "data.path": data / "train.jsonl",
        "parallel.pp": 1,
        "rollout.engines.type": "sglang",
        "rollout.engines.launch_command": engine,
        "rollout.max_staleness": staleness,
        "rollout.prompts_per_step": args.prompts,
        "rollout.samples_per_prompt": args.samples,
        "rollout.max_new_tokens": args.max_new_tokens,
        "advantages.dynamic_sampling": "false",
        "reward.num_workers": 1,
        "rollout.producer_cpus": "[1]" if staleness else "[]",
        # The off-policy correction (docs/async.md): the PPO ratio against the policy being
        # trained, importance weights against the engine's.
        "loss.old_logprobs": "learner",
        "loss.tis_level": "token",
        "train.total_steps": steps,
        "train.num_iterations": args.iterations,
        "train.save_interval": 0,
        "metrics.tensorboard": "false",
    }
    overrides.update(item.split("=", 1) for item in args.set)
    argv = ["taskset", "-c", "0", sys.executable, "-m", "megatron_grpo.cli", "train"]
    argv += ["--config", str(CONFIG), "--nproc", "1"]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def timing(rows: list[dict]) -> dict[str, float]:
    """Steps per second and the learner's idle fraction, over the steps after SKIP."""
    kept = rows[SKIP:]
    wait = sum(r["perf/time_rollout_s"] for r in kept)
    total = wait + sum(r["perf/time_train_s"] + r["perf/time_sync_s"] for r in kept)
    return {
        "steps_per_s": len(kept) / total,
        "idle_fraction": wait / total,
        "final_reward": statistics.mean(r["rollout/reward_mean"] for r in rows[-3:]),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--iterations", type=int, default=5, help="train.num_iterations")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, SKIP + 3
    work = Path(tempfile.mkdtemp(prefix="mgrpo_bench_async_"))
    data = assets(work, quick=args.quick)
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    modes = list(runs)
    for rep in range(args.repeats):
        for mode in modes[rep % 2 :] + modes[: rep % 2]:
            rows = run(
                work / f"{mode}_{rep}",
                data,
                staleness=1 if mode == "async" else 0,
                steps=args.steps,
                args=args,
            )
            runs[mode].append(timing(rows))
            print(mode, rep, runs[mode][-1], flush=True)
    speedup = Ratio.of(
        "steps_per_s_staleness1/synchronous",
        [a["steps_per_s"] / s["steps_per_s"] for a, s in zip(runs["async"], runs["sync"])],
    )
    print(speedup.line(1.4, at_most=False))
    for mode in modes:
        idle = summary([r["idle_fraction"] for r in runs[mode]])
        print(f"{mode}: learner idle fraction median {idle['median']:.3f}")
    write_result(
        "async_rl",
        args.out,
        {
            "quick": args.quick,
            "settings": vars(args),
            "speedup": speedup,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
