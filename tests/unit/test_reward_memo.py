"""The memo of a deterministic reward: one call per distinct job, the same values as without."""

import functools
import sys

import pytest

from megatron_grpo.config import RemoteRewardConfig, RewardConfig
from megatron_grpo.rewards import RewardScorer
from megatron_grpo.rewards.memo import RewardMemo, is_deterministic
from megatron_grpo.rewards.pool import RewardCancelled
from megatron_grpo.rewards.runner import RewardRunner
from megatron_grpo.rewards.text import exact_match


class Counting:
    """``len(response) + label``, with every job it was called on recorded."""

    deterministic = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, response, label, metadata):
        self.calls.append((response, label, metadata))
        if response == "boom":
            raise ZeroDivisionError("boom!")
        return float(len(response) + label)

    def batch(self, jobs):
        values = []
        for job in jobs:
            try:
                values.append(self(*job))
            except Exception as e:
                values.append(e)
        return values


def test_a_batch_calls_once_per_distinct_job():
    fn, memo = Counting(), RewardMemo(10)
    jobs = [("ab", 1, {}), ("ab", 1, {}), ("abc", 1, {}), ("ab", 2, {}), ("ab", 1, {"k": 1})]
    assert memo.run(jobs, fn.batch) == [3.0, 3.0, 4.0, 4.0, 3.0]
    # The same response with another label or other metadata is another job.
    assert fn.calls == [("ab", 1, {}), ("abc", 1, {}), ("ab", 2, {}), ("ab", 1, {"k": 1})]


def test_values_are_kept_across_batches_and_the_least_recent_go_first():
    fn, memo = Counting(), RewardMemo(2)
    memo.run([("a", 0, None), ("bb", 0, None)], fn.batch)
    memo.run([("a", 0, None)], fn.batch)  # "a" is now the most recent
    assert len(fn.calls) == 2
    memo.run([("ccc", 0, None)], fn.batch)  # drops "bb"
    assert len(memo) == 2
    assert memo.run([("a", 0, None), ("bb", 0, None)], fn.batch) == [1.0, 2.0]
    assert [c[0] for c in fn.calls] == ["a", "bb", "ccc", "bb"]


def test_a_batch_larger_than_the_memo_still_gets_every_value():
    fn, memo = Counting(), RewardMemo(1)
    assert memo.run([("a", 0, None), ("bb", 0, None), ("a", 0, None)], fn.batch) == [1.0, 2.0, 1.0]
    assert memo.run([("a", 0, None), ("bb", 0, None)], fn.batch) == [1.0, 2.0]


def test_an_exception_is_shared_in_its_batch_but_never_kept():
    fn, memo = Counting(), RewardMemo(10)
    first = memo.run([("boom", 0, None), ("boom", 0, None)], fn.batch)
    assert all(isinstance(v, ZeroDivisionError) for v in first) and len(fn.calls) == 1
    memo.run([("boom", 0, None)], fn.batch)
    assert len(fn.calls) == 2


def test_which_functions_count_as_deterministic():
    scorer = RewardScorer(RewardConfig(type="math"))
    assert scorer.memo is not None
    assert is_deterministic(functools.partial(exact_match, case_sensitive=False))
    assert is_deterministic(Counting())
    assert not is_deterministic(lambda response, label, meta: 1.0)
    assert RewardScorer(RewardConfig(type="math", cache_size=0)).memo is None
    remote = RewardConfig(type="remote", remote=RemoteRewardConfig(url="http://127.0.0.1:1/score"))
    assert RewardScorer(remote).memo is None


def test_the_math_scorer_gives_the_same_rewards_with_and_without_the_memo():
    responses = ["\\boxed{12}", "12", "\\boxed{12}", "13", "\\boxed{\\frac{1}{2}}", "0.5", "x"]
    labels = ["12", "12", "13", "13", "0.5", "0.5", "12"]
    metas = [{}] * len(responses)
    plain = RewardScorer(RewardConfig(type="math", cache_size=0)).score(responses, labels, metas)
    memo = RewardScorer(RewardConfig(type="math"))
    for _ in range(2):  # the second batch comes from the memo
        assert memo.score(responses, labels, metas) == plain
    assert plain.rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert memo.memo is not None and len(memo.memo) == len(responses)


CUSTOM = """
calls = []

def scored(response, label, metadata):
    calls.append(response)
    return float(len(response))

scored.deterministic = True

def unmarked(response, label, metadata):
    calls.append(response)
    return 1.0
"""


def test_a_custom_function_is_memoized_only_when_it_says_so(tmp_path, monkeypatch):
    name = "grpo_test_memo_rewards"
    (tmp_path / f"{name}.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for fn, calls in (("scored", ["a", "bb"]), ("unmarked", ["a", "bb", "a", "a"])):
            module = __import__(name)
            module.calls.clear()
            scorer = RewardScorer(RewardConfig(type="custom", custom_function=f"{name}:{fn}"))
            scorer.score(["a", "bb", "a"], [None] * 3, [{}] * 3)
            scorer.score(["a"], [None], [{}])
            assert module.calls == calls
    finally:
        sys.modules.pop(name, None)


def test_a_negative_cache_size_is_refused_by_name():
    with pytest.raises(ValueError, match="reward.cache_size must be >= 0, got -1"):
        RewardConfig(cache_size=-1)


def test_threads_sharing_a_small_memo_each_get_their_own_values():
    import threading

    memo, errors = RewardMemo(3), []

    def score(offset: int) -> None:
        fn = Counting()
        for round_ in range(200):
            jobs = [("x" * ((offset + round_ + k) % 7), offset, None) for k in range(5)]
            want = [float(len(r) + label) for r, label, _ in jobs]
            if memo.run(jobs, fn.batch) != want:
                errors.append((offset, round_))

    threads = [threading.Thread(target=score, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(memo) <= 3


def test_a_batch_stopped_at_a_failure_keeps_only_what_was_scored():
    """on_error=fail through the memo: the distinct jobs after the failure are never called,
    and their ``RewardCancelled`` is not kept (the next batch calls them)."""
    fn, memo = Counting(), RewardMemo(10)
    run = functools.partial(RewardRunner(fn).run, stop_if=lambda v: isinstance(v, Exception))
    jobs = [("ab", 1, {}), ("boom", 1, {}), ("ab", 1, {}), ("abc", 1, {})]
    values = memo.run(jobs, run)
    assert values[0] == values[2] == 3.0
    assert isinstance(values[1], ZeroDivisionError) and isinstance(values[3], RewardCancelled)
    assert fn.calls == [("ab", 1, {}), ("boom", 1, {})] and len(memo) == 1
    assert memo.run([("abc", 1, {})], run) == [4.0]
