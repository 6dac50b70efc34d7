"""End to end, through the real CLI on the demo's assets: the on-policy gates
(``train.gates``) pass the demo, and stop a run whose engines do not sample from the
learner's policy, before its optimizer step, with one line and a non-zero exit, keeping
what was written.

The faults are real: an engine process (``stale_engine.py``, the embedded server started
by ``rollout.engines.launch_command``) that answers weight updates and keeps its own
weights, and a rollout hook (``retokenizing_hook.py``) that trains on its completions
re-encoded with another vocabulary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from demo_run import ROOT, demo_argv

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
FIRST_STEP_OFF = (
    "train.gates.first_step_mismatch=0",
    "train.gates.first_step_mismatch_max=0",
    "train.gates.first_step_rollout_kl=0",
)


def stale_engine(load_format: str) -> tuple[str, ...]:
    """An engine that keeps the weights it started with: random (``dummy``) or
    ``train.init``'s (``auto``)."""
    command = (
        f"{sys.executable} {HERE / 'stale_engine.py'} --model-path {{model}} --host {{host}} "
        f"--port {{port}} --load-format {load_format} --seed 7"
    )
    return ("rollout.engines.type=sglang", f"rollout.engines.launch_command={command}")


def train(out: Path, assets: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    args = demo_argv(out, assets, *overrides)
    return subprocess.run(args, capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stopped(done: subprocess.CompletedProcess, *, step: int, when: str, option: str) -> str:
    """The one line a gate ended the run with (asserted to be there, and last)."""
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-grpo: error: rank "), done.stderr[-3000:]
    assert f"OffPolicyError: on-policy gate: step {step} ({when}): train/" in last
    assert f"is above train.gates.{option}=" in last
    assert "Traceback" not in done.stderr
    return last


def test_the_demo_passes_its_gates(tmp_path, assets):
    done = train(tmp_path, assets, "train.total_steps=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:  # float32 on both sides: far below the thresholds (1e-3, 0.1, 1e-4)
        assert r["train/logprob_mismatch"] < 1e-5
        assert r["train/logprob_mismatch_max"] < 1e-4
        assert abs(r["train/rollout_kl"]) < 1e-6


def test_an_engine_with_other_weights_stops_the_run_at_step_1(tmp_path, assets):
    done = train(tmp_path, assets, "train.total_steps=2", *stale_engine("dummy"))
    line = stopped(done, step=1, when="the first of a new run", option="first_step_mismatch")
    value = float(line.split("train/logprob_mismatch = ")[1].split()[0])
    assert value > 1.0  # random weights against the learner's: nats apart
    assert "weights are not the learner's" in line
    assert rows(tmp_path) == []  # step 1 was never logged, nor trained
    assert not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "config.yaml").exists()


def test_tokens_re_encoded_with_another_vocabulary_stop_the_run_at_step_1(tmp_path, assets):
    hook = ("rollout.hook=retokenizing_hook:retokenized", "train.total_steps=2")
    done = train(tmp_path, assets, *hook)
    line = stopped(done, step=1, when="the first of a new run", option="first_step_mismatch")
    assert "tokenizer or chat template" in line
    assert rows(tmp_path) == []


@pytest.fixture(scope="module")
def stale_engine_run(tmp_path_factory, assets):
    """A fresh copy, for each test, of a run of two steps with an engine that started from
    ``train.init`` and takes no push: they pass, since the learner moves little under the
    learning rate's warm-up. The copy is where the run was made (its config names it)."""
    root = tmp_path_factory.mktemp("stale_init")
    out, kept = root / "run", root / "two_steps"
    done = train(out, assets, "train.total_steps=2", "train.save_interval=1", *stale_engine("auto"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [1, 2]
    out.rename(kept)

    def fresh_copy() -> Path:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(kept, out)
        return out

    return fresh_copy


def test_after_a_resume_an_engine_that_lost_the_push_stops_the_first_step(stale_engine_run, assets):
    out = stale_engine_run()
    done = train(out, assets, "train.total_steps=4", "train.save_interval=1", *stale_engine("auto"))
    stopped(done, step=3, when="the first after a resume", option="first_step_mismatch")
    assert [r["step"] for r in rows(out)] == [1, 2]  # kept
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_00000001",
        "step_00000002",
    ]


def test_a_mismatch_that_runs_away_stops_a_later_step(stale_engine_run, assets):
    out = stale_engine_run()
    gates = (*FIRST_STEP_OFF, "train.gates.stop_mismatch=0.02")  # a resume may change them
    done = train(
        out, assets, "train.total_steps=6", "train.save_interval=1", *gates, *stale_engine("auto")
    )
    stopped(done, step=4, when="a later step", option="stop_mismatch")
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3]  # step 3 trained and kept
    assert logged[2]["train/logprob_mismatch"] > 0.02  # above, but the first step's gates are off
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1] == "step_00000003"
