"""The colocated turns (train/colocation.py): the order of the transitions, and a failed or
late one stopping the run with its name."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_grpo.config import ColocateConfig
from megatron_grpo.sglang_api.errors import RolloutHTTPError
from megatron_grpo.train.colocation import (
    LEARNER_AFTER_PUSH,
    LEARNER_BEFORE_PUSH,
    Colocation,
    ColocationError,
)


class Offload:
    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def offload(self, parts) -> None:
        if self.fail:
            raise RuntimeError("pinned memory exhausted")
        self.log.append(("offload", tuple(parts)))

    def reload(self) -> None:
        self.log.append(("reload",))


class Engines:
    """The memory calls of ``EngineCalls``, recorded; ``hang``/``refuse`` a call by name."""

    def __init__(self, log: list, *, hang: str = "", refuse: str = "") -> None:
        self.log, self.hang, self.refuse = log, hang, refuse

    async def _call(self, name: str, tags) -> None:
        if name == self.hang:
            await asyncio.sleep(3600)
        if name == self.refuse:
            raise RolloutHTTPError(
                url=f"http://e0/{name}_memory_occupation", status=400, body="nope"
            )
        self.log.append((name, tuple(tags)))

    async def release_memory_occupation(self, tags=None) -> None:
        await self._call("release", tags)

    async def resume_memory_occupation(self, tags=None) -> None:
        await self._call("resume", tags)


class Runtime:
    def __init__(self, engines: Engines) -> None:
        self.weight_client = engines
        self.io = self

    def run(self, coro):
        return asyncio.run(coro)


def colocation(log, *, offload=("optimizer", "grads", "params"), timeout=30.0, **engines):
    cfg = ColocateConfig(offload=list(offload), transition_timeout_s=timeout)
    c = Colocation(cfg, Offload(log), is_main=True)
    c.engines_started(Runtime(Engines(log, **engines)))
    return c


def one_step(c: Colocation) -> None:
    """What the loop does in a step, in its order (train/loop.py)."""
    c.release_engines()  # after the rollout
    c.learner_in()
    c.learner_out(LEARNER_BEFORE_PUSH)
    c.resume_weights()
    c.learner_out(LEARNER_AFTER_PUSH)
    c.resume_kv_cache()


def test_a_step_runs_the_transitions_in_order():
    log: list = []
    c = colocation(log)
    one_step(c)
    assert log == [
        ("release", ("weights", "kv_cache", "cuda_graph")),  # at start: the engines came up awake
        ("release", ("weights", "kv_cache", "cuda_graph")),
        ("reload",),
        ("offload", ("optimizer", "grads")),
        ("resume", ("weights",)),
        ("offload", ("params",)),
        ("resume", ("kv_cache", "cuda_graph")),
    ]
    assert c.engines_awake == ("weights", "kv_cache", "cuda_graph")


def test_only_the_configured_parts_are_offloaded():
    log: list = []
    one_step(colocation(log, offload=("optimizer",)))
    assert [e for e in log if e[0] == "offload"] == [("offload", ("optimizer",))]


def test_a_release_that_does_not_complete_stops_the_run_naming_it():
    log: list = []
    c = Colocation(ColocateConfig(transition_timeout_s=0.3), Offload(log), is_main=True)
    t0 = time.monotonic()
    with pytest.raises(ColocationError) as err:
        c.engines_started(Runtime(Engines(log, hang="release")))
    assert time.monotonic() - t0 < 5
    assert str(err.value) == (
        "rollout.placement: colocated: release the engines' memory at start failed: not "
        "complete after 0.3 s (rollout.colocate.transition_timeout_s); the run stops here"
    )


def test_a_refused_resume_names_the_transition_the_step_and_the_engine():
    log: list = []
    c = colocation(log, refuse="resume")
    c.step = 3
    with pytest.raises(
        ColocationError,
        match=r"resume the engines' weights at step 3 failed: "
        r"RolloutHTTPError: http://e0/resume_memory_occupation answered HTTP 400: nope",
    ):
        c.resume_weights()
    assert "weights" not in c.engines_awake


def test_a_failed_offload_names_it():
    c = Colocation(ColocateConfig(), Offload([], fail=True), is_main=True)
    c.step = 2
    with pytest.raises(
        ColocationError,
        match="offload the learner's optimizer, grads to host "
        "at step 2 failed: RuntimeError: pinned memory exhausted",
    ):
        c.learner_out(LEARNER_BEFORE_PUSH)


def test_other_ranks_call_no_engine():
    log: list = []
    c = Colocation(ColocateConfig(), Offload(log), is_main=False)
    c.resume_weights()
    c.release_engines()
    assert log == []
