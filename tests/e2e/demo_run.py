"""The command line of a training run on the CPU demo's assets (see conftest.assets)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "cpu_demo" / "grpo.yaml"


def demo_argv(out: Path, assets: Path, *overrides: str, nproc: int = 2) -> list[str]:
    """``megatron-grpo train --nproc`` on the demo, 4 prompts x 4 samples per step."""
    args = [
        sys.executable,
        "-m",
        "megatron_grpo.cli",
        "train",
        "--config",
        str(CONFIG),
        "--nproc",
        str(nproc),
        "--set",
        f"output_dir={out}",
        "--set",
        f"tokenizer={assets / 'model'}",
        "--set",
        f"train.init={assets / 'model'}",
        "--set",
        f"data.path={assets / 'train.jsonl'}",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "rollout.samples_per_prompt=4",
        "--set",
        "metrics.tensorboard=false",
    ]
    return args + [x for o in overrides for x in ("--set", o)]
