"""End to end: training on two-turn episodes of a rollout hook (tests/e2e/two_turn_hook.py)
with the embedded engine: the learner's log-probs are the engine's on every model token
of both turns, and the tokens between the turns are no loss tokens."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from demo_run import ROOT, demo_argv
from two_turn_hook import TOOL_TEXT

from megatron_grpo.rollout.stage import replay

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

HOOK = (
    "rollout.hook=two_turn_hook:two_turns",
    "rollout.max_new_tokens=8",
    "train.total_steps=2",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, assets):
    out = tmp_path_factory.mktemp("hook")
    dump = f"rollout.dump_dir={out / 'dump'}"
    args = demo_argv(out, assets, *HOOK, dump, "parallel.pp=1", nproc=1)
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, capture_output=True, text=True, timeout=360, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def test_learner_log_probs_match_the_engine_on_every_turn(run):
    _, rows = run
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/turns_mean"] == 2.0 for r in rows)
    # mean over every loss token: the model tokens of both turns (fp32 on both sides)
    assert all(r["train/logprob_mismatch"] <= 1e-5 for r in rows), rows


def test_tokens_between_turns_are_masked_and_the_engine_matches_transformers(run, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run
    samples = replay(out / "dump", 1).samples
    hf = AutoModelForCausalLM.from_pretrained(assets / "model").float().eval()
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    tool_ids = tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    worst = 0.0
    for s in samples:
        mask = s.loss_mask.tolist()
        first = mask.index(1.0)
        # a first turn of 1 or 2 tokens (it may end at the end of sequence), the three
        # tokens of "tool output" (mask 0, log-prob 0), then the second turn
        added = mask.index(0.0, first)
        assert 1 <= added - first <= 2
        assert mask[added:] == [0.0] * 3 + [1.0] * (len(mask) - added - 3)
        assert len(mask) > added + 3
        assert s.tokens[added : added + 3].tolist() == tool_ids
        assert s.rollout_logprobs[added : added + 3].tolist() == [0.0] * 3
        with torch.no_grad():
            logits = hf(input_ids=s.tokens[None]).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, s.tokens[1:, None])[:, 0]
        on = s.loss_mask[1:] > 0
        worst = max(worst, float((logp[on] - s.rollout_logprobs[1:][on]).abs().max()))
    # step 1 samples came from the initial weights, the checkpoint transformers loads
    assert worst <= 1e-5, worst
