"""The CPU tool-use example (examples/tool_demo) in brief: its assets, and one RL step of
its config (one process) in which the model calls the calculator through the tool loop,
evaluated through the loop as well; and the demo's own assets, whose model must be able
to use the calculator's result."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from demo_run import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(180)]


def test_tool_demo_trains_with_the_calculator(tmp_path):
    assets, out = tmp_path / "assets", tmp_path / "run"
    prepare = [sys.executable, str(ROOT / "examples/tool_demo/prepare.py"), "--out", str(assets),
               "--warmup-steps", "20", "--copy-target", "0", "--tool-fraction", "0.5"]  # fmt: skip
    subprocess.run(prepare, check=True, capture_output=True, timeout=240, cwd=ROOT)
    overrides = {
        "output_dir": out,
        "tokenizer": assets / "model",
        "train.init": assets / "model",
        "data.path": assets / "train.jsonl",
        "train.total_steps": 1,
        "parallel.pp": 1,
        "rollout.prompts_per_step": 4,
        "metrics.tensorboard": "false",
        "eval.datasets": f"[{{name: arith, path: {assets / 'eval.jsonl'}, max_prompts: 4}}]",
    }
    args = [sys.executable, "-m", "megatron_grpo.cli", "train", "--nproc", "1",
            "--config", str(ROOT / "examples/tool_demo/grpo.yaml")]  # fmt: skip
    args += [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # step 0: the initial policy's evaluation
    assert all(0 <= r["eval/arith/pass@1"] <= r["eval/arith/pass@4"] <= 1 for r in rows)
    rows = rows[1:]
    # the warm-up taught the format: some episodes call the calculator and read its result
    assert sum(r["rollout/tool_calls_mean"] for r in rows) > 0
    assert all(r["rollout/turns_mean"] >= 1 for r in rows)
    assert all(r["train/logprob_mismatch"] <= 1e-5 for r in rows)


@pytest.mark.timeout(600)
def test_the_demos_warmed_up_model_copies_the_calculators_result(tmp_path):
    """GRPO can find that calling the calculator pays only if the model then writes the
    result it was given. A fixed 200-step warm-up stopped in the middle of learning that
    copy: on an AVX-512 machine the model copied one result in five, and the demo learned
    to avoid the tool (reward 0.09 -> 0.06, tool calls 0.23 -> 0.03)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    prepare = [sys.executable, str(ROOT / "examples/tool_demo/prepare.py"), "--out", str(tmp_path)]
    done = subprocess.run(prepare, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    # the ids as tokenizer.json spells them (AutoTokenizer may rebuild a Qwen2 pipeline)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "model")
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    copied = 0
    for row in rows:  # the held-out problems, after a right call: greedy, as the trace goes on
        expression, answer = row["prompt"].rstrip("="), row["label"]
        text = f"{row['prompt']}<call>calculator {expression}</call><r>{answer}</r>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        written: list[int] = []
        with torch.no_grad():
            while len(written) < 4 and tokenizer.eos_token_id not in written:
                logits = model(input_ids=torch.tensor([ids + written])).logits
                written.append(int(logits[0, -1].argmax()))
        copied += tokenizer.decode(written, skip_special_tokens=True) == answer
    assert copied / len(rows) >= 0.7, f"copies {copied} of {len(rows)} results"
