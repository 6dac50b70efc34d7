"""check-invariance with routing replay (``train.routing_replay``) on the tiny Qwen3-MoE:
R3 replays an engine's routes (random top-k sets, so that replay changes every layer's
experts), R2 the behaviour pass's own routes in the second, off-policy pass; every mode,
1 and 3 micro-batches, permuted and packed, at the expert-parallel layouts, and the
single-process run against transformers with the same routes forced on its routers; and
the routers rerun by full recomputation at PP 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import REFERENCE, Layout, check
from megatron_grpo.commands.invariance.cases import default_moe_model
from megatron_grpo.config import MODES

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
