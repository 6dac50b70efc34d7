"""TRL's GRPOTrainer on the CPU demo's model, prompts and reward: one side of bench/vs_trl.py.

Run as ``python bench/_trl_grpo.py --assets DIR --events FILE --steps N`` in an
environment that has ``trl`` (an optional bench dependency, never the trainer's).
The settings mirror ``examples/cpu_demo/grpo.yaml``: 32 prompts x 8 samples per
step, at most 4 new tokens at temperature 1, token-level loss ("dapo") with clip
0.2 / 0.28, no KL, Adam at 1e-3 with 3 warm-up steps, gradient clipping at 1.0,
fp32, one process on the CPU.

Each step appends one JSON line to ``--events``: the wall-clock times (``time.time``)
at which the step began and ended, and the seconds spent in generation and scoring
(``_generate_and_score_completions``); the rest of the step is training.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--assets", required=True, help="examples/cpu_demo/prepare.py's output")
    p.add_argument("--events", required=True, help="JSON lines, one per step")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from megatron_grpo.rewards.math_answer import math_reward

    transformers.logging.set_verbosity_error()
    assets = Path(args.assets)
    rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])

    def reward(completions, label, **_):
        return [math_reward(c, x) for c, x in zip(completions, label)]

    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.samples,
            num_generations=args.samples,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            learning_rate=1e-3,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=3,
            weight_decay=0.0,
            max_grad_norm=1.0,
            epsilon=0.2,
            epsilon_high=0.28,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=args.seed,
        )
        trainer = GRPOTrainer(
            model=str(assets / "model"),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=transformers.AutoTokenizer.from_pretrained(assets / "model"),
        )
        timer = _StepTimer(Path(args.events))
        trainer.add_callback(timer.callback())
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            start = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                timer.rollout_s += time.perf_counter() - start

        trainer._generate_and_score_completions = timed_generate
        trainer.train()


class _StepTimer:
    """Writes one line per optimizer step: its begin and end times, its rollout seconds and
    the mean reward TRL logged for it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.begin = 0.0
        self.rollout_s = 0.0
        self.row: dict[str, float] = {}

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.begin, timer.rollout_s = time.time(), 0.0

            def on_step_end(self, args, state, control, **kwargs):
                end = time.time()
                timer.row = {
                    "step": state.global_step,
                    "begin": timer.begin,
                    "end": end,
                    "rollout_s": timer.rollout_s,
                    "train_s": end - timer.begin - timer.rollout_s,
                }

            def on_log(self, args, state, control, logs=None, **kwargs):
                # The trainer logs every step (logging_steps=1), right after its end.
                if not timer.row or logs is None or "reward" not in logs:
                    return
                with timer.path.open("a") as f:
                    f.write(json.dumps({**timer.row, "reward": logs["reward"]}) + "\n")
                timer.row = {}

        return Callback()


if __name__ == "__main__":
    main()
