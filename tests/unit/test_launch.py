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
