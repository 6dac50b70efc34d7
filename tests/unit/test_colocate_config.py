"""``rollout.placement: colocated`` and ``rollout.colocate``: what is refused when the config
is read, with the message a user sees."""

from __future__ import annotations

import pytest

from megatron_grpo.config import ColocateConfig, EnginesConfig, RolloutConfig, WeightSyncConfig

SGLANG = "python -m sglang.launch_server --model-path {model} --port {port}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": 1}, "asynchronous RL generates while the learner trains"),
        (
            {"engines": EnginesConfig(embedded_server="thread")},
            "releases and resumes its memory as a process of its own",
        ),
        (
            {"engines": EnginesConfig(type="sglang", urls=["http://r"], router_url="http://r")},
            "not through a router",
        ),
        (
            {"engines": EnginesConfig(type="sglang", launch_command=SGLANG, num_servers=2)},
            r"rollout.engines.num_servers is not used there \(got 2\)",
        ),
        ({"sync": WeightSyncConfig(method="disk")}, "not rollout.sync.method: disk"),
    ],
)
def test_what_colocation_cannot_go_with(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(placement="colocated", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": ["optimizer", "kv"]}, r"takes optimizer, grads, params; got \['kv'\]"),
        ({"mem_fraction_static": 1.0}, r"must be in \(0, 1\), got 1.0"),
        ({"engine_tp": 3}, "must be a power of two >= 1, got 3"),
        ({"transition_timeout_s": 0}, "must be > 0"),
    ],
)
def test_bad_colocate_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ColocateConfig(**kwargs)


def test_colocated_embedded_engines_serve_from_processes():
    assert RolloutConfig(placement="colocated").embedded_process
    assert not RolloutConfig().embedded_process
