"""check-invariance with routing replay (``train.routing_replay``) on the tiny Qwen3-MoE:
R3 replays an engine's routes (random top-k sets, so that replay changes every layer's
experts), R2 the behaviour pass's own routes in the second, off-policy pass; every mode,
1 and 3 micro-batches, permuted and packed, at the expert-parallel layouts, and the
single-process run against transformers with the same routes forced on its routers; and
the routers rerun by full recomputation at PP 2."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import REFERENCE, Layout, check
from megatron_grpo.commands.invariance.cases import default_moe_model
from megatron_grpo.config import MODES
from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = [Layout.parse(x) for x in "2x1x1x2,1x2x1x2,2x1x2x2".split(",")]
WORKERS = str(Path(__file__).with_name("workers_moe.py"))
TOLERANCE = 1e-5


def _check(*features: str, layouts=LAYOUTS, **kwargs):
    lines: list[str] = []
    errors = check(
        layouts,
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        features=features,
        model_cfg=default_moe_model(),
        timeout=900,
        log=lines.append,
        **kwargs,
    )
    print("\n".join(lines))
    return errors


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("feature", ["r3", "r2"])
def test_routing_replay_passes_check_invariance(feature):
    errors = _check(feature)
    assert all(e["grad"] < TOLERANCE for e in errors[REFERENCE].values()), errors[REFERENCE]
    for layout in map(str, LAYOUTS):
        assert len(errors[layout]) == len(MODES) * 8 * 2
        bad = {name: e for name, e in errors[layout].items() if max(e.values()) > TOLERANCE}
        assert not bad, (layout, bad)


@pytest.mark.timeout(600)
def test_routes_not_sliced_for_sequence_parallelism_fail_r3():
    """The planted bug: each TP rank replays the first positions' routes instead of its own
    slice of the sequence. The reference (TP 1) is right; the TP layout must fail."""
    errors = _check(
        "r3",
        layouts=[Layout.parse("1x2x1x2")],
        worker=f"{WORKERS}:unsliced_routes_layout",
    )
    worst = max(max(e.values()) for e in errors["1x2x1x2"].values())
    assert worst > 1e-2, worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("features", [("recompute",), ("r3", "recompute")])
def test_recomputed_routers_keep_their_micro_batch_under_1f1b(features):
    """Full recomputation reruns each router in the backward pass, after 1F1B has run later
    micro-batches' forwards at PP 2: the balance loss and the replayed routes must still be
    those of the router's own micro-batch."""
    errors = _check(*features, layouts=[Layout.parse("2x1x2x2")])
    bad = {name: e for name, e in errors["2x1x2x2"].items() if max(e.values()) > TOLERANCE}
    assert len(errors["2x1x2x2"]) == len(MODES) * 8 * 2 and not bad, bad


@pytest.mark.timeout(300)
def test_r3_brings_an_engine_that_routes_otherwise_back_to_the_dense_mismatch():
    """The engine (the embedded engine's decode, on the learner's weights) selects experts
    from logits with a 5% error; its gates are exact. Without replay some top-k sets differ
    and the log-prob mismatch is far above the float32 level; with R3 the learner uses the
    engine's experts and the mismatch is back at it (docs/options.md, "Routing replay")."""
    run = functools.partial(run_workers, f"{WORKERS}:engine_mismatch", 1, timeout=240)
    (exact,) = run(kwargs={"mode": "off", "perturbed": False})
    (off,) = run(kwargs={"mode": "off", "perturbed": True})
    (r3,) = run(kwargs={"mode": "r3", "perturbed": True})
    assert exact["router_agreement"] == 1.0 and exact["logprob_mismatch"] <= 1e-6
    assert off["router_agreement"] < 0.99 and off["router_agreement_own"] < 0.99
    assert off["logprob_mismatch"] > 100 * exact["logprob_mismatch"]
    assert r3["router_agreement"] == 1.0 and r3["router_agreement_own"] < 0.99
    assert r3["logprob_mismatch"] <= 1e-6 and r3["logprob_mismatch_max"] <= 1e-5
