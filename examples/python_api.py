"""GRPO from Python: the CPU demo (verifiable addition, a tiny model) trained through
``megatron_grpo.train`` with a reward function written the way TRL writes them.

    python examples/python_api.py                 # 10 steps, one process, runs/python_api
    python examples/python_api.py --steps 2 --set rollout.prompts_per_step=4

The assets (data, tokenizer, warmed-up model) are made by examples/cpu_demo/prepare.py
when missing. ``accuracy`` lives in ``__main__`` and is handed over as an object: that works
in this process (``nproc=1``); other processes need it from a module (docs/python_api.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from megatron_grpo import train

ROOT = Path(__file__).resolve().parents[1]


def accuracy(completions, label, **kwargs):
    """TRL's signature: a batch of completions, the dataset's columns by name."""
    return [1.0 if c.strip() == answer else 0.0 for c, answer in zip(completions, label)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=ROOT / "runs/cpu_demo/assets")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/python_api")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    model = args.assets / "model"
    if not (model / "config.json").exists():
        prepare = ROOT / "examples/cpu_demo/prepare.py"
        subprocess.run([sys.executable, str(prepare), "--out", str(args.assets)], check=True)

    result = train(
        ROOT / "examples/cpu_demo/grpo.yaml",
        [
            f"output_dir={args.out}",
            f"tokenizer={model}",
            f"train.init={model}",
            f"data.path={args.assets / 'train.jsonl'}",
            f"parallel.pp={args.nproc}",  # the demo's pipeline: one stage per process
            f"train.total_steps={args.steps}",
            *args.overrides,
        ],
        reward_fn=accuracy,
        nproc=args.nproc,
    )
    final = result.final
    print(f"{result.output_dir}: step {final['step']}, reward {final['rollout/reward_mean']:.3f}")


if __name__ == "__main__":
    main()
