"""``rollout.placement: colocated`` end to end on CPU: the demo trains as it does
disaggregated, and each failed transition (injected for real on the engine's process) stops
the run naming it, without a hang, the checkpoints before it intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from demo_run import ROOT
from test_train import train

from megatron_grpo.train.state import latest_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

FAULTS = Path(__file__).with_name("colocated_faults.py")
STEPS = ("train.total_steps=3", "rollout.sync.check=checksum")
SAME = (
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/logprob_mismatch",
)


def test_colocated_trains_as_disaggregated(assets, tmp_path):
    """The same engine (an embedded server process) at the same seeds, taking turns with the
    learner or not: the same samples, losses and gradients, step for step; PP 2 over 2
    processes, distributed optimizer, checksummed pushes."""
    apart = train(tmp_path / "apart", assets, *STEPS, "rollout.engines.embedded_server=process")
    shared = train(tmp_path / "shared", assets, *STEPS, "rollout.placement=colocated")
    assert len(shared) == len(apart) == 3
    for a, s in zip(apart, shared, strict=True):
        for key in SAME:
            assert s[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (s["step"], key)


def run_fault(fault: str, assets: Path, out: Path, returncode: int = 1) -> str:
    done = subprocess.run(
        [sys.executable, str(FAULTS), fault, str(assets), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_release_that_does_not_complete_stops_the_run(assets, tmp_path):
    error = run_fault("release_hangs", assets, tmp_path / "run")
    assert error == (
        "ERROR ColocationError: rollout.placement: colocated: release the engines' memory at "
        "step 2 failed: not complete after 10 s (rollout.colocate.transition_timeout_s); the "
        "run stops here"
    )
    assert latest_checkpoint(tmp_path / "run").name.endswith("1")


def test_a_refused_resume_stops_the_run_and_the_run_resumes(assets, tmp_path):
    out = tmp_path / "run"
    error = run_fault("resume_refused", assets, out)
    assert error.startswith(
        "ERROR ColocationError: rollout.placement: colocated: resume the engines' weights at "
        "step 2 failed: RolloutHTTPError: "
    ), error
    assert error.endswith(
        '/resume_memory_occupation answered HTTP 400: {"error": {"message": '
        '"/resume_memory_occupation: weights not released (released: kv_cache, cuda_graph)"}}; '
        "the run stops here"
    ), error
    # Step 2 trained and was saved before its push; the run takes up from there.
    assert latest_checkpoint(out).name.endswith("2")
    assert run_fault("none", assets, out, returncode=0) == "DONE"
    assert latest_checkpoint(out).name.endswith("3")


def test_a_push_into_an_engine_asleep_is_refused_by_name(assets, tmp_path):
    error = run_fault("push_asleep", assets, tmp_path / "run")
    assert error.startswith("ERROR RolloutError: weight sync failed: stage 0: RolloutHTTPError: ")
    assert error.endswith(
        '/update_weights_from_tensor answered HTTP 400: {"error": {"message": '
        "\"/update_weights_from_tensor refused: the engine's weights memory is released "
        '(/release_memory_occupation); /resume_memory_occupation first"}}'
    ), error
    assert latest_checkpoint(tmp_path / "run").name.endswith("2")
