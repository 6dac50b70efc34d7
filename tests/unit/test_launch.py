import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_grpo.launch import WorkerError, run_workers

HERE = Path(__file__)


def rank_and_world(scale: int) -> tuple[int, int]:
    import os

    return int(os.environ["RANK"]) * scale, int(os.environ["WORLD_SIZE"])


def hang() -> None:
    time.sleep(600)


def fail_on_rank_one() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("rank one broke")
    time.sleep(600)


def test_results_come_back_by_rank():
    assert run_workers(f"{HERE}:rank_and_world", 3, kwargs={"scale": 10}, timeout=60) == [
        (0, 3),
        (10, 3),
        (20, 3),
    ]


def test_a_hang_times_out_fast():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out after 3s"):
        run_workers(f"{HERE}:hang", 2, timeout=3)
    assert time.monotonic() - start < 30


def test_a_failing_rank_stops_the_others_and_shows_its_error():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank\(s\) \[1\] failed.*rank one broke"):
        run_workers(f"{HERE}:fail_on_rank_one", 2, timeout=120)
    assert time.monotonic() - start < 60


EMBEDDED_MODEL_DIR = """
import sys, time
from megatron_grpo.config import EnginesConfig, ModelConfig, RolloutConfig
from megatron_grpo.launch import use_private_tempdir
from megatron_grpo.rollout import engines

def servers_started(launch):  # stands for the servers: say where their model is, then serve
    print(launch.model, flush=True)
    time.sleep(600)

engines.launch_servers = servers_started
use_private_tempdir()  # as megatron-grpo train does before training
model = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    vocab_size=32, add_qkv_bias=True)
rollout = RolloutConfig(engines=EnginesConfig(embedded_server="process"))
engines.launch_embedded(rollout, model, seed=0)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_process_leaves_no_temporary_model_directory(tmp_path, sig):
    """An embedded server's model directory, made in /tmp by the main rank, is removed when
    that process is killed (SIGKILL: no handler, no atexit) by the watcher of its tempdir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", EMBEDDED_MODEL_DIR],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        model_dir = Path(child.stdout.readline().strip())
        assert (model_dir / "config.json").is_file()
        assert model_dir.parent.parent == tmp  # tmp/<this process's>/mgrpo_embedded_model_*
        child.send_signal(sig)
        child.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(tmp.iterdir()), list(tmp.rglob("*"))
    finally:
        child.kill()
        child.wait()


def test_the_private_tempdir_goes_at_a_normal_exit_too(tmp_path):
    code = (
        "import tempfile; from megatron_grpo.launch import use_private_tempdir; "
        "use_private_tempdir(); print(tempfile.mkdtemp(), flush=True)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert Path(out.stdout.strip()).parent.parent == tmp_path
    deadline = time.monotonic() + 5
    while any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(tmp_path.iterdir())
