"""The other ranks wait for the main rank's rollout outside collectives (``train.main_wait``).

Injected for real on the demo (2 processes): a reward that sleeps makes each rollout last
about three times ``train.collective_timeout_s``, and the run still completes; then the
main rank's process is frozen (SIGSTOP) in the middle of a rollout, and the other rank
stops with an error that says so within about the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from demo_run import ROOT, demo_argv
from test_reliability import logged_steps, processes_naming, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(420)]

SLOW_REWARD = """
import os, pathlib, time

def score(response, label, metadata):
    pathlib.Path(os.environ["SLOW_REWARD_MARK"]).touch()
    time.sleep(float(os.environ["SLOW_REWARD_S"]))
    return 1.0
"""


def slow_run(tmp_path: Path, assets: Path, timeout_s: int, per_sample_s: float, *extra: str):
    """The demo's command line and environment with a reward of ``per_sample_s`` a sample."""
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    argv = demo_argv(
        tmp_path / "run",
        assets,
        f"train.collective_timeout_s={timeout_s}",
        "reward.type=custom",
        "reward.custom_function=slow_reward:score",
        "advantages.dynamic_sampling=false",  # a constant reward: no group would be kept
        *extra,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "SLOW_REWARD_S": str(per_sample_s),
        "SLOW_REWARD_MARK": str(tmp_path / "scoring"),
    }
    return argv, env


def test_a_rollout_three_times_the_collective_timeout_completes(tmp_path, assets):
    # 16 samples x 1.5 s: the rollout takes about 24 s, the collectives' limit is 8 s.
    run_dir = tmp_path
    argv, env = slow_run(run_dir, assets, 8, 1.5, "train.total_steps=1")
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_steps(run_dir / "run") == [1]
    assert time.monotonic() - start > 16 * 1.5  # the rollout really was that long


def test_a_frozen_main_rank_is_reported(tmp_path, assets):
    run_dir = tmp_path
    argv, env = slow_run(run_dir, assets, 6, 0.5, "train.total_steps=50")
    launch = subprocess.Popen(
        argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    main = None
    try:
        wait_for((run_dir / "scoring").exists, 300, "the first rollout's scoring")
        main = next(p for p in processes_naming(str(run_dir / "run")) if _rank(p) == "0")
        os.kill(main, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = launch.communicate(timeout=200)
        waited = time.monotonic() - stopped
    finally:
        if main is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(main, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
    assert launch.returncode != 0
    assert "the main rank has shown no sign of life for 6 s during its rollout" in err, err[-3000:]
    assert "frozen or hung" in err
    assert waited < 120


def _rank(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    values = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if e)
    return values.get("RANK") if "TORCHELASTIC_RUN_ID" in values else None
