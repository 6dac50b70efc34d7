"""Reward functions run concurrently: async ones on one event loop, sync ones in worker
processes with a hard time limit."""

import logging
import sys
import time

import pytest

from megatron_grpo.rewards import (
    RewardConfig,
    RewardError,
    RewardScorer,
    RewardTimeout,
    WorkerPool,
)

MODULE = """
import asyncio
import time

running = 0
most_running = 0

async def slow_length(response, label, metadata):
    global running, most_running
    running += 1
    most_running = max(most_running, running)
    try:
        await asyncio.sleep(float(metadata.get("sleep", 0.2)))
    finally:  # cancelled too
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

def sleep_then_fail(response, label, metadata):
    time.sleep(float(metadata["sleep"]))
    raise ValueError(f"wrong answer {response!r}")
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


# ------------------------------------------------- on_error=fail stops at the first failure
# 32 samples, timeout_s = 2: each path stops within one timeout_s (plus a second), where
# scoring the whole batch took from 16 s to a minute.

N, TIMEOUT_S = 32, 2.0


def fail_fast(module: str, function: str, **kwargs) -> RewardScorer:
    return scorer(module, function, timeout_s=TIMEOUT_S, on_error="fail", **kwargs)


def score_until_error(s: RewardScorer, responses, metadatas) -> tuple[RewardError, float]:
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        s.score(responses, [None] * len(responses), metadatas)
    return info.value, time.monotonic() - start


def test_fail_inline_stops_at_the_first_failure(module):
    """No time limit inline (the function's own, e.g. math-verify's): the batch stops
    after the first sample instead of trying all 32 (each 1 s, then an exception)."""
    s = fail_fast(module, "sleep_then_fail")
    error, elapsed = score_until_error(s, [f"r{i}" for i in range(N)], [{"sleep": 1.0}] * N)
    assert elapsed < 1.0 + 1.0, f"took {elapsed:.1f} s"
    assert str(error) == (
        f"reward custom {module}:sleep_then_fail failed on sample 0 (response 'r0'): "
        "ValueError: wrong answer 'r0'"
    )


def test_fail_async_stops_at_a_hang_after_one_timeout(module):
    """Four at a time, every one hanging: the first four time out and the rest never start."""
    s = fail_fast(module, "slow_length", max_concurrency=4)
    error, elapsed = score_until_error(s, ["a"] * N, [{"sleep": 600}] * N)
    assert elapsed < TIMEOUT_S + 1.0, f"took {elapsed:.1f} s"
    assert isinstance(error.cause, RewardTimeout) and error.index in range(4)
    assert "ran past 2 s (reward.timeout_s)" in str(error)
    assert sys.modules[module].running == 0  # the hanging calls were cancelled


def test_fail_async_stops_at_a_raise_and_names_it(module):
    responses = ["a"] * N
    metadatas = [{"sleep": 600}] * N
    responses[5], metadatas[5] = "boom", {"sleep": 0.1}
    error, elapsed = score_until_error(fail_fast(module, "slow_length"), responses, metadatas)
    assert elapsed < 1.0, f"took {elapsed:.1f} s"
    assert error.index == 5 and isinstance(error.cause, ZeroDivisionError)
    assert "sample 5 (response 'boom'): ZeroDivisionError: boom!" in str(error)
    assert sys.modules[module].running == 0


@pytest.fixture
def started(module):
    """A scorer with two worker processes, started (a worker's start is not a sample's)."""
    s = fail_fast(module, "sync_length", num_workers=2)
    assert s.score(["ab", "abc"], [None] * 2, [{}] * 2).rewards == [2.0, 3.0]
    yield s
    s.close()


def test_fail_in_workers_stops_at_a_hang_after_one_timeout(started):
    workers = [w.process for w in started.runner.pool._workers]
    error, elapsed = score_until_error(started, ["hang"] * N, [{}] * N)
    assert elapsed < TIMEOUT_S + 1.0, f"took {elapsed:.1f} s"
    assert isinstance(error.cause, RewardTimeout) and "worker process was killed" in str(error)
    assert not any(p.is_alive() for p in workers)  # both were on a hanging sample
    # The next batch starts its workers again.
    assert started.score(["xy"], [None], [{}]).rewards == [2.0]


def test_fail_in_workers_stops_at_a_raise_and_kills_the_busy_worker(started):
    workers = [w.process for w in started.runner.pool._workers]
    responses = ["hang"] * N
    responses[0] = "boom"
    error, elapsed = score_until_error(started, responses, [{}] * N)
    assert elapsed < 1.0, f"took {elapsed:.1f} s"
    assert error.index == 0 and isinstance(error.cause, ZeroDivisionError)
    assert not any(p.is_alive() for p in workers)  # one raised, then took a hang


def test_errors_of_a_batch_are_one_warning(module, caplog):
    """on_error=zero: a batch's failures are logged as one line, with how many and the first."""
    s = scorer(module, "slow_length", timeout_s=0.5, on_error="zero")
    responses = ["a", "bb", "boom", "ccc", "d", "boom", "e", "f"]
    metadatas = [{}, {"sleep": 60}, {}, {"sleep": 60}, {}, {}, {"sleep": 60}, {}]
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.rewards"):
        result = s.score(responses, [None] * 8, metadatas)
        s.score(["a", "b"], [None] * 2, [{}] * 2)  # no failure: nothing logged
        s.score(["boom"], [None], [{}], warn=False)  # the caller logs the failures itself
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert result.num_errors == 5 and len(result.errors) == 5
    assert [r.getMessage() for r in caplog.records] == [
        f"reward custom {module}:slow_length: 5 of 8 samples failed (3 RewardTimeout, "
        "2 ZeroDivisionError), scored 0; first: sample 1 (response 'bb'): RewardTimeout: "
        "reward function ran past 0.5 s (reward.timeout_s)"
    ]


class _Tokens:
    """A tokenizer whose ids are characters (GroupScoring decodes each sample)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class _Sample:
    def __init__(self, text):
        self.output_ids = [ord(c) for c in text]


def _group_scoring(s: RewardScorer, groups: int, sleeps: dict[int, float]):
    from megatron_grpo.rollout.scoring import GroupScoring

    metadatas = [{"sleep": sleeps.get(p, 0.01)} for p in range(groups)]
    return GroupScoring(s, _Tokens(), [None] * groups, metadatas)


def test_group_scoring_stops_at_the_first_failed_group_and_names_it_in_the_batch(module):
    """Groups scored while generation goes on: group 2 fails, every later group hangs;
    the groups after the failure are not scored, and the error counts in the batch."""
    s = fail_fast(module, "slow_length")
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        with _group_scoring(s, 8, {p: 600 for p in range(3, 8)} | {2: 0.05}) as scoring:
            for p in range(8):
                scoring.submit(p, [_Sample("boom" if p == 2 else "ok")] * 4)
            scoring.result(group_size=4)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 1.0, f"took {elapsed:.1f} s"
    assert info.value.index == 8 and "(response 'boom')" in str(info.value)
    assert str(info.value).startswith(f"reward custom {module}:slow_length failed on sample 8")


def test_group_scoring_logs_the_failures_of_all_groups_in_one_line(module, caplog):
    s = scorer(module, "slow_length", on_error="zero")
    with caplog.at_level(logging.WARNING), _group_scoring(s, 4, {}) as scoring:
        for p in range(4):
            scoring.submit(p, [_Sample("boom" if p in (1, 3) else "ok")] * 2)
        result = scoring.result(group_size=2)
    assert result.rewards == [2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    assert result.errors[0].startswith("sample 2: ZeroDivisionError")
    assert result.errors[-1].startswith("sample 7: ZeroDivisionError")
    (line,) = [r.getMessage() for r in caplog.records if "samples failed" in r.getMessage()]
    assert line == (
        f"reward custom {module}:slow_length: 4 of 8 samples failed, scored 0; "
        "first: sample 2: ZeroDivisionError: boom!"
    )
