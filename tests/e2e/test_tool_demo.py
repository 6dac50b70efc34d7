"""The CPU tool-use example (examples/tool_demo) in brief: its assets, and two RL steps of
its config in which the model calls the calculator through the tool loop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from demo_run import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]


def test_tool_demo_trains_with_the_calculator(tmp_path):
    assets, out = tmp_path / "assets", tmp_path / "run"
    prepare = [sys.executable, str(ROOT / "examples/tool_demo/prepare.py"), "--out", str(assets),
               "--warmup-steps", "60", "--tool-fraction", "0.5"]  # fmt: skip
    subprocess.run(prepare, check=True, capture_output=True, timeout=240, cwd=ROOT)
    overrides = {
        "output_dir": out,
        "tokenizer": assets / "model",
        "train.init": assets / "model",
        "data.path": assets / "train.jsonl",
        "train.total_steps": 2,
        "rollout.prompts_per_step": 4,
        "metrics.tensorboard": "false",
    }
    args = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", "2",
            "--config", str(ROOT / "examples/tool_demo/grpo.yaml")]  # fmt: skip
    args += [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the warm-up taught the format: some episodes call the calculator and read its result
    assert sum(r["rollout/tool_calls_mean"] for r in rows) > 0
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
    assert all(r["train/logprob_mismatch"] <= 1e-5 for r in rows)
