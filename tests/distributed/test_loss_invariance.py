"""The loss contract, end to end: one global batch, one gradient, whatever the layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import Layout, check
from megatron_grpo.config import MODES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = [Layout.parse(x) for x in "1x1x1,2x1x1,1x2x1,1x1x2,2x2x1,2x1x2,1x2x2".split(",")]
WORKERS = str(Path(__file__).with_name("workers_loss.py"))
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def report():
    """All modes x layouts x {1, 3} micro-batches x {original, permuted} + packed: 7 launches."""
    lines: list[str] = []
    errors = check(
        LAYOUTS,
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        permute=True,
        timeout=600,
        log=lines.append,
    )
    return errors, lines


@pytest.mark.parametrize("layout", [str(x) for x in LAYOUTS])
def test_gradient_update_and_grad_norm_match_single_process(report, layout):
    cases = report[0][layout]
    # every mode: 1 and 3 micro-batches, in order and permuted, and permuted + packed; 2 passes
    assert len(cases) == len(MODES) * 5 * 2
    bad = {name: e for name, e in cases.items() if max(e.values()) > TOLERANCE}
    assert not bad, bad


def test_the_check_exercises_clipping_kl_and_several_micro_batches(report):
    """The second pass is off-policy (some tokens clip), KL is on, and the planner split
    the batch into several micro-batches, unevenly over DP ranks somewhere."""
    lines = report[1]
    clipped, kl = re.search(
        r"clipped tokens up to ([\d.]+)%.*KL up to ([\d.e+-]+)", lines[0]
    ).groups()
    assert 5.0 < float(clipped) < 95.0 and float(kl) > 1e-3, lines[0]
    splits = " ".join(line.split("micro-batches per DP rank")[-1] for line in lines[1:])
    assert re.search(r"\b(\d+)/(?!\1\b)\d+", splits), splits  # unequal counts over DP ranks
    assert re.search(r"\b[2-9]\b", splits), splits


@pytest.mark.parametrize(
    "bug, layout",
    [
        ("local-denominator", Layout(2, 1, 1)),
        ("uncancelled-microbatch-mean", Layout(1, 1, 1)),
        ("planner-duplicates-sample", Layout(2, 1, 1)),
    ],
)
def test_check_catches_planted_bugs(bug, layout):
    """The check is not vacuous: peers' bugs planted in the loss path, and a bug planted in
    the trainer's planner, make it fail."""
    errs = check(
        [layout],
        modes=["token-mean"],
        micro_batch_counts=[1, 3],
        permute=False,
        worker=f"{WORKERS}:planted_bug_layout",
        worker_kwargs={"bug": bug},
        timeout=600,
    )
    worst = max(max(e.values()) for e in errs[str(layout)].values())
    assert worst > 0.1, errs
