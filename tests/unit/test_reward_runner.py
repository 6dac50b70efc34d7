"""Reward functions run concurrently: async ones on one event loop, sync ones in worker
processes with a hard time limit."""

import sys
import time

import pytest

from megatron_grpo.rewards import RewardConfig, RewardScorer, RewardTimeout, WorkerPool

MODULE = """
import asyncio
import time

running = 0
most_running = 0

async def slow_length(response, label, metadata):
    global running, most_running
    running += 1
    most_running = max(most_running, running)
    await asyncio.sleep(float(metadata.get("sleep", 0.2)))
    running -= 1
    if response == "boom":
        raise ZeroDivisionError("boom!")
    return len(response)

def most_running_so_far(response, label, metadata):
    return most_running

class AsyncCall:
    async def __call__(self, response, label, metadata):
        await asyncio.sleep(0.2)
        return 1.0

call_object = AsyncCall()

def sync_length(response, label, metadata):
    if response == "hang":
        time.sleep(600)  # as stuck as C code that no signal interrupts
    if response == "boom":
        raise ZeroDivisionError("boom!")
    if response == "die":
        import os
        os._exit(3)  # a crash in C code, or the OS killing it
    return len(response)
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = "grpo_test_concurrent_rewards"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get sys.path too
    yield name
    sys.modules.pop(name, None)


def scorer(module: str, function: str, **kwargs) -> RewardScorer:
    return RewardScorer(
        RewardConfig(type="custom", custom_function=f"{module}:{function}", **kwargs)
    )


def test_async_rewards_run_at_once(module):
    n = 20
    start = time.monotonic()
    result = scorer(module, "slow_length").score(["x" * i for i in range(n)], [None] * n, [{}] * n)
    elapsed = time.monotonic() - start
    assert result.rewards == [float(i) for i in range(n)]
    assert elapsed < 0.25 * n * 0.2, f"{n} rewards sleeping 0.2 s each took {elapsed:.2f} s"
    assert sys.modules[module].most_running == n


def test_async_concurrency_is_capped(module):
    n = 10
    scorer(module, "slow_length", max_concurrency=3).score(["a"] * n, [None] * n, [{}] * n)
    assert sys.modules[module].most_running == 3


def test_async_call_method_counts_as_async(module):
    start = time.monotonic()
    result = scorer(module, "call_object").score(["a"] * 10, [None] * 10, [{}] * 10)
    assert result.rewards == [1.0] * 10
    assert time.monotonic() - start < 1.0


def test_async_errors_and_timeouts_are_per_sample(module):
    s = scorer(module, "slow_length", timeout_s=0.5, on_error="zero")
    metas = [{}, {"sleep": 30}, {}]
    start = time.monotonic()
    result = s.score(["ab", "never", "boom"], [None] * 3, metas)
    assert time.monotonic() - start < 5
    assert result.rewards == [2.0, 0.0, 0.0]
    assert result.errors[0].startswith("sample 1: RewardTimeout: reward function ran past 0.5 s")
    assert result.errors[1] == "sample 2: ZeroDivisionError: boom!"


@pytest.mark.timeout(120)
def test_worker_processes_kill_a_stuck_sample(module):
    s = scorer(module, "sync_length", num_workers=2, timeout_s=2.0, on_error="zero")
    try:
        responses = ["a", "hang", "boom", "abcd", "abc"]
        result = s.score(responses, [None] * 5, [{}] * 5)
        assert result.rewards == [1.0, 0.0, 0.0, 4.0, 3.0]
        assert result.errors[0].startswith("sample 1: RewardTimeout: reward function ran past 2 s")
        assert result.errors[1] == "sample 2: ZeroDivisionError: boom!"  # raised as it was
        # The killed worker was replaced: the next batch uses both workers again.
        assert s.score(["xy", "xyz"], [None] * 2, [{}] * 2).rewards == [2.0, 3.0]
        assert len(s.runner.pool._workers) == 2
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_stuck_sample_inside_a_chunk_times_out_alone(module):
    """One worker takes the batch as one chunk: the sample after the stuck one is scored by
    the worker that replaces it, and the one before keeps its result."""
    s = scorer(module, "sync_length", num_workers=1, timeout_s=1.0, on_error="zero")
    try:
        result = s.score(["ab", "hang", "abc", "abcd"], [None] * 4, [{}] * 4)
        assert result.rewards == [2.0, 0.0, 3.0, 4.0]
        assert len(result.errors) == 1 and result.errors[0].startswith("sample 1: RewardTimeout")
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_worker_that_dies_fails_its_sample_only(module):
    s = scorer(module, "sync_length", num_workers=1, on_error="zero")
    try:
        result = s.score(["ab", "die", "abc"], [None] * 3, [{}] * 3)
        assert result.rewards == [2.0, 0.0, 3.0]
        assert result.errors == ["sample 1: RuntimeError: reward worker process died (exit code 3)"]
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_math_reward_in_worker_processes():
    s = RewardScorer(RewardConfig(type="math", num_workers=2, math_timeout_s=1))
    try:
        responses = [r"\boxed{\frac12}", r"\boxed{(10^{100})!}", r"\boxed{0.5}", "no"]
        assert s.score(responses, ["0.5"] * 4, [{}] * 4).rewards == [1.0, 0.0, 1.0, 0.0]
    finally:
        s.close()


def test_worker_pool_checks_its_arguments():
    with pytest.raises(ValueError, match="num_workers >= 1"):
        WorkerPool(len, num_workers=0, timeout_s=1.0)
    assert issubclass(RewardTimeout, TimeoutError)
