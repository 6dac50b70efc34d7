"""The loss contract, end to end: one global batch, one gradient, whatever the layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import BF16_TOLERANCE, REFERENCE, Layout, check
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
def test_gradient_update_grad_norm_and_replicas_match_single_process(report, layout):
    cases = report[0][layout]
    # every mode: 1 and 3 micro-batches, in order and permuted, permuted + packed, the
    # batch with an empty DP rank, and the sparse-groups batch at 1 and 3; 2 passes
    assert len(cases) == len(MODES) * 8 * 2
    assert sum("/empty-rank/" in name for name in cases) == len(MODES) * 2
    assert sum("/sparse-groups/" in name for name in cases) == len(MODES) * 2 * 2
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


def test_the_single_process_gradient_equals_one_computed_outside_megatron_core(report):
    """transformers with the same weights and the loss written from its definition."""
    errors = report[0][REFERENCE]
    assert sorted(errors) == sorted([*MODES, *(f"{m}/sparse-groups" for m in MODES)])
    assert all(e["grad"] < TOLERANCE for e in errors.values()), errors
    assert any("vs transformers" in line for line in report[1])


def test_a_factor_every_layout_shares_is_caught_by_the_reference_outside_megatron():
    """megatron-core's division by the token count, let through, scales every layout alike:
    the layouts agree with each other; the transformers reference does not."""
    errs = check(
        [Layout(2, 1, 1)],
        modes=["token-mean"],
        micro_batch_counts=[1],
        permute=False,
        pack=False,
        worker=f"{WORKERS}:planted_bug_layout",
        worker_kwargs={"bug": "token-count-division"},
        timeout=600,
    )
    assert max(max(e.values()) for e in errs["2x1x1"].values()) < TOLERANCE, errs
    assert errs[REFERENCE]["token-mean"]["grad"] > 0.5, errs[REFERENCE]


def test_a_tp_rank_with_unreduced_norm_gradients_is_caught_by_the_replica_comparison():
    errs = check(
        [Layout(1, 2, 1)],
        modes=["token-mean"],
        micro_batch_counts=[1],
        permute=False,
        pack=False,
        features=("sp",),
        worker=f"{WORKERS}:planted_bug_layout",
        worker_kwargs={"bug": "unreduced-norm-grad"},
        timeout=600,
    )
    assert max(e["replicas"] for e in errs["1x2x1"].values()) > 1e-2, errs["1x2x1"]


@pytest.mark.parametrize(
    "features, layouts",
    [
        (("distopt",), ["2x1x1"]),
        (("sp", "recompute"), ["1x2x1", "1x1x2"]),
        (("selective",), ["1x1x2"]),
        (("bf16",), ["2x1x1"]),
        (("vpp",), ["1x1x2", "2x1x2"]),
    ],
)
def test_scale_features_keep_the_gradient(features, layouts):
    """Every mode, at the layouts where each feature applies, against the plain
    single-process run (bf16 within its stated tolerance)."""
    lines: list[str] = []
    errs = check(
        [Layout.parse(x) for x in layouts],
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        features=features,
        timeout=600,
        log=lines.append,
    )
    tolerance = BF16_TOLERANCE if "bf16" in features else TOLERANCE
    for layout in layouts:
        line = next(x for x in lines if x.startswith(f"layout {layout:>7}"))
        active = re.search(r"\(features: ([^)]*)\)", line)
        assert active and set(active.group(1).split(", ")) <= set(features), line
        assert active.group(1) != "none", line
        bad = {n: e for n, e in errs[layout].items() if max(e.values()) > tolerance}
        assert not bad, bad
        if "distopt" in features:  # raw gradients are sharded: updates and norms only
            assert all("grad" not in e for e in errs[layout].values())
