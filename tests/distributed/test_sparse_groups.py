"""check-invariance where DP ranks hold a few of the prompt groups each, as at scale.

At 8 samples a group over 64 DP ranks most ranks lack most groups. The sparse-groups
batch lays its groups out that way at DP2 and DP4 (``tests/unit/test_plan.py``). A
planner that numbers each rank's groups 0, 1, ... passes every other case at DP2 (each
rank holds every group of those batches, so its numbering is the batch's); it must fail
these cases in the modes that count groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import Layout, check
from megatron_grpo.config import MODES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKERS = str(Path(__file__).with_name("workers_loss.py"))
TOLERANCE = 1e-5
GROUP_MODES = ("group-token-mean", "group-seq-mean")


def _check(dp: int, **kwargs) -> dict[str, dict[str, float]]:
    """Every mode at DPx1x1, 1 and 3 micro-batches in order (no permutation, no packing)."""
    errors = check(
        [Layout(dp, 1, 1)],
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        permute=False,
        pack=False,
        timeout=120,
        log=lambda line: None,
        **kwargs,
    )
    return errors[f"{dp}x1x1"]


def _worst(cases: dict[str, dict[str, float]], mode: str, sparse: bool) -> float:
    return max(
        max(e.values())
        for name, e in cases.items()
        if name.startswith(f"{mode}/") and ("/sparse-groups/" in name) == sparse
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [2, 4])
def test_sparse_groups_cases_pass(dp):
    cases = _check(dp)
    assert sum("/sparse-groups/" in name for name in cases) == len(MODES) * 2 * 2
    bad = {name: e for name, e in cases.items() if max(e.values()) > TOLERANCE}
    assert not bad, bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [2, 4])
def test_group_ids_numbered_per_rank_fail_the_group_modes(dp):
    """The planted planner bug: the group modes fail on the sparse-groups batch; the other
    modes never read group ids and pass."""
    cases = _check(
        dp,
        worker=f"{WORKERS}:planted_bug_layout",
        worker_kwargs={"bug": "rank-local-group-ids"},
    )
    for mode in MODES:
        worst = _worst(cases, mode, sparse=True)
        assert worst > 1e-2 if mode in GROUP_MODES else worst < TOLERANCE, (mode, worst)
        if dp == 2:  # what the cases missed before the sparse-groups batch
            assert _worst(cases, mode, sparse=False) < TOLERANCE, mode
