"""The CPU demo's loop end to end with the learner on the GPU: ``megatron-grpo train`` on the
demo's config and assets, one process (nccl, the Transformer Engine spec, float32 as the demo
is: TF32 GEMMs), the embedded rollout server as the demo has it (on the CPU; weights pushed
from the GPU through shared memory), a few steps, a checkpoint at the end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
from gpu_tier import ROOT, record

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 3


def test_demo_trains_a_few_steps_on_the_gpu(tmp_path):
    assets, out = tmp_path / "assets", tmp_path / "out"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/cpu_demo/prepare.py"), "--out", str(assets)]
        + ["--warmup-steps", "10"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    overrides = {
        "output_dir": out,
        "tokenizer": assets / "model",
        "train.init": assets / "model",
        "data.path": assets / "train.jsonl",
        "parallel.pp": 1,  # one GPU: one process
        "train.total_steps": STEPS,
        "rollout.prompts_per_step": 8,
        "rollout.samples_per_prompt": 4,
        "metrics.tensorboard": "false",
    }
    argv = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", "1", "--config"]
    argv += [str(ROOT / "examples/cpu_demo/grpo.yaml")]
    argv += [f"--set={k}={v}" for k, v in overrides.items()]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"]), row
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"
    record(
        "demo",
        {
            "steps": STEPS,
            "wall_s": seconds,
            "reward_mean": [r.get("rollout/reward_mean") for r in rows],
            "time_train_s": [r.get("perf/time_train_s") for r in rows],
        },
    )
