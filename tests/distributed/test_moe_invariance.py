"""check-invariance with expert parallelism: a tiny Qwen3-MoE with the routers' balance
loss on, every loss mode, 1 and 3 micro-batches, permuted, packed and with an empty DP
rank, through the trainer's own step, at DPxTPxPPxEP layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.commands.invariance import REFERENCE, Layout, check
from megatron_grpo.commands.invariance.cases import default_moe_model
from megatron_grpo.config import MODES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = [Layout.parse(x) for x in "1x1x1x1,2x1x1x2,1x2x1x2,2x1x2x2".split(",")]
WORKERS = str(Path(__file__).with_name("workers_moe.py"))
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def report():
    lines: list[str] = []
    errors = check(
        LAYOUTS,
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        model_cfg=default_moe_model(),
        timeout=900,
        log=lines.append,
    )
    print("\n".join(lines))
    return errors, lines


@pytest.mark.parametrize("layout", [str(x) for x in LAYOUTS])
def test_gradient_update_and_balance_loss_match_single_process(report, layout):
    cases = report[0][layout]
    assert len(cases) == len(MODES) * 8 * 2  # the cases of test_loss_invariance
    assert all("aux_loss" in e for e in cases.values())  # the balance loss was on
    bad = {name: e for name, e in cases.items() if max(e.values()) > TOLERANCE}
    assert not bad, bad


def test_the_single_process_gradient_equals_transformers_with_the_balance_loss(report):
    errors = report[0][REFERENCE]
    assert sorted(errors) == sorted([*MODES, *(f"{m}/sparse-groups" for m in MODES)])
    assert all(e["grad"] < TOLERANCE for e in errors.values()), errors


def test_megatron_cores_per_micro_batch_aux_loss_is_caught():
    """Its gradient is scaled per micro-batch and depends on how tokens share one."""
    errs = check(
        [Layout(2, 1, 1, 2)],
        modes=["token-mean"],
        micro_batch_counts=[1, 3],
        permute=False,
        pack=False,
        model_cfg=default_moe_model(),
        worker=f"{WORKERS}:megatron_aux_loss_layout",
        timeout=900,
    )
    assert errs[REFERENCE]["token-mean"]["grad"] > 1e-3, errs[REFERENCE]
    worst = max(max(e.get(k, 0.0) for k in ("grad", "update")) for e in errs["2x1x1x2"].values())
    assert worst > 1e-3, errs["2x1x1x2"]


@pytest.mark.parametrize(
    "features, layout",
    [(("distopt", "selective"), "2x1x1x2"), (("vpp",), "2x1x2x2")],
)
def test_scale_features_keep_the_moe_gradient(features, layout):
    """The distributed optimizer (experts' states over expert-DP), selective recomputation
    and the interleaved pipeline with expert parallelism, against the plain single process."""
    errs = check(
        [Layout.parse(layout)],
        modes=["token-mean", "group-seq-mean"],
        micro_batch_counts=[1, 3],
        features=features,
        model_cfg=default_moe_model(),
        timeout=900,
    )
    bad = {n: e for n, e in errs[layout].items() if max(e.values()) > TOLERANCE}
    assert not bad, bad
    assert all("aux_loss" in e for e in errs[layout].values())
