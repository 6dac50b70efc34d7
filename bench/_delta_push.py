"""``bench/weight_sync.py --delta``'s two halves: the CPU demo's weights before and after one RL
step of the trainer, and the side-by-side pushes of them, full and delta.

``rl_step`` runs the demo (``examples/cpu_demo/grpo.yaml``, two processes, PP2) from its
warmed-up model through its learning-rate warm-up and one step more, exporting the policy
after each step (``train.save_hf_interval``); the last two exports are the weights before
and after one step at the demo's full learning rate (the warm-up's first step has lr 0 and
changes nothing). The assets are made first where they are missing
(``examples/cpu_demo/prepare.py``). ``compare`` pushes the
two in turn through a stage's sender (``StageSender``) to two embedded servers, one fed full
pushes and one deltas, so that every push after the first is a delta of one RL step.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import torch
from _common import BENCH_DIR, Ratio, measure, summary

ROOT = BENCH_DIR.parent
DEMO_CONFIG = ROOT / "examples" / "cpu_demo" / "grpo.yaml"


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files."""
    from safetensors.torch import load_file

    named: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        named |= load_file(path)
    return named


def rl_step(assets: Path, out: Path) -> tuple[Path, Path]:
    """(the model before, the model after) one RL step of the CPU demo at its full learning
    rate, as HF directories."""
    from megatron_grpo import api
    from megatron_grpo.config.loader import read_yaml

    if not (assets / "model" / "config.json").exists():
        prepare = ROOT / "examples" / "cpu_demo" / "prepare.py"
        subprocess.run([sys.executable, str(prepare), "--out", str(assets)], check=True)
    steps = read_yaml(DEMO_CONFIG)["optim"]["lr_warmup_steps"] + 1
    api.train(
        DEMO_CONFIG,
        {
            "output_dir": str(out),
            "tokenizer": str(assets / "model"),
            "data.path": str(assets / "train.jsonl"),
            "train.init": str(assets / "model"),
            "train.total_steps": steps,
            "train.save_interval": 0,
            "train.save_hf_interval": 1,
            "metrics.tensorboard": False,
        },
        nproc=2,
    )
    *_, before, after = sorted((out / "hf").glob("step_*"))
    return before, after


class Side:
    """An embedded server and a long-lived sender (its delta state lasts across pushes)."""

    def __init__(self, config, *, delta: bool) -> None:
        from megatron_grpo.config import RolloutConfig, WeightSyncConfig
        from megatron_grpo.config.hf import model_config_from_hf
        from megatron_grpo.mcore import device
        from megatron_grpo.rollout.runtime import RolloutRuntime, client_config
        from megatron_grpo.testing import random_hf_model
        from megatron_grpo.weight_sync.sender import StageSender

        cfg = RolloutConfig(sync=WeightSyncConfig(delta=delta, bucket_mb=64))
        self.runtime = RolloutRuntime(
            cfg, hf_model=random_hf_model(config, seed=0), model_cfg=model_config_from_hf(config)
        )
        self.sender = StageSender(
            functools.partial(client_config, self.runtime.cfg),
            0,
            backend=device.distributed_backend(),
        )
        self.sent: list[int] = []

    def push(self, named: dict[str, torch.Tensor], version: str) -> None:
        from megatron_grpo.weight_sync.engines import begin_push, finish_push

        plan = begin_push(self.runtime, version)
        report = self.sender.send(iter([named]), plan)
        assert report.error is None and finish_push(self.runtime, plan, [report])
        self.sent.append(report.sent_bytes if plan.delta else report.nbytes)

    def close(self) -> None:
        self.sender.close()
        self.runtime.close()


def compare(config, models: list[dict[str, torch.Tensor]], dtype: torch.dtype, repeats: int):
    """Push ``models`` in turn (each cast to ``dtype``), full and delta, ``repeats`` times
    after a first push of each side that is not counted; the ratios of bytes and times."""
    weights = [{k: v.to(dtype) for k, v in named.items()} for named in models]
    full, delta = Side(config, delta=False), Side(config, delta=True)
    times: dict[str, list] = {"full": [], "delta": []}
    try:
        for step in range(repeats + 1):
            named = weights[step % len(weights)]
            order = [("full", full), ("delta", delta)][:: 1 if step % 2 else -1]
            for name, side in order:
                timing = measure(functools.partial(side.push, named, str(step + 1)))
                if step:
                    times[name].append(timing)
    finally:
        full.close()
        delta.close()
    pairs = list(zip(times["delta"], times["full"], strict=True))
    return {
        "bytes_full": sum(v.numel() * v.element_size() for v in weights[0].values()),
        "bytes": Ratio.of(
            f"{dtype} delta/full [bytes sent]",
            [d / f for d, f in zip(delta.sent[1:], full.sent[1:], strict=True)],
        ),
        "wall": Ratio.of(f"{dtype} delta/full [push wall]", [d.wall / f.wall for d, f in pairs]),
        "cpu": Ratio.of(
            f"{dtype} delta/full [push cpu, servers included]", [d.cpu / f.cpu for d, f in pairs]
        ),
        "full_wall_s": summary([t.wall for t in times["full"]]),
        "delta_wall_s": summary([t.wall for t in times["delta"]]),
    }
