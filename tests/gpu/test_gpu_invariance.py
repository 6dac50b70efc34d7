"""check-invariance on the GPU: nccl, the Transformer Engine spec (the trainer's choice
there), bf16 against the float32 reference.

- 1x1x1 with bf16 on one GPU: every loss mode, 1 and 3 micro-batches, permuted, packed
  (THD in bf16), the batch with an empty rank; the float32 reference itself against
  transformers (TF32 tolerance: TE's float32 GEMMs are TF32).
- TP2 (with sequence parallelism), PP2 and DP2 in bf16, and EP2 (MoE, float32: TF32
  tolerance) layouts: one GPU per rank. On a one-GPU machine they run only
  where NCCL lets two ranks share the device (a probe decides); otherwise they are skipped,
  saying so. gloo is no stand-in: megatron-core's collectives on CUDA tensors need NCCL.
"""

from __future__ import annotations

import pytest
from gpu_tier import layout_skip_reason, record

from megatron_grpo.commands.invariance import (
    BF16_TOLERANCE,
    REFERENCE,
    TF32_TOLERANCE,
    Layout,
    check,
)
from megatron_grpo.commands.invariance.cases import default_moe_model
from megatron_grpo.config import MODES

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _worst(errors: dict) -> float:
    return max(max(e.values()) for e in errors.values())


def test_bf16_with_the_te_spec_at_1x1x1(tmp_path):
    from megatron_grpo.mcore.layers import have_transformer_engine

    assert have_transformer_engine(), "the GPU tier runs with transformer_engine importable"
    lines: list[str] = []
    errors = check(
        [Layout(1, 1, 1)],
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        features=("bf16",),
        timeout=240,
        log=lines.append,
    )
    record(
        "invariance_1x1x1_bf16",
        {
            "lines": lines,
            "worst_bf16": _worst(errors["1x1x1"]),
            "reference_vs_transformers": _worst(errors[REFERENCE]),
        },
    )
    assert any("(features: bf16)" in line for line in lines), lines
    assert any("/packed/" in name for name in errors["1x1x1"]), sorted(errors["1x1x1"])
    assert _worst(errors["1x1x1"]) < BF16_TOLERANCE, errors["1x1x1"]
    assert _worst(errors[REFERENCE]) < TF32_TOLERANCE, errors[REFERENCE]


LAYOUTS = [
    ("2x1x1", None),
    ("1x2x1", None),
    ("1x1x2", None),
    ("2x1x1x2", "moe"),
]


@pytest.mark.parametrize("layout, model", LAYOUTS)
def test_multi_rank_layouts(layout, model, shared_device):
    parsed = Layout.parse(layout)
    reason = layout_skip_reason(parsed.world_size, shared_device)
    if reason:
        pytest.skip(reason)
    # Dense in bf16; MoE in float32 (TF32 GEMMs): in bf16 a near-tie between two experts can
    # route a token differently from the float32 reference, which no layout is to blame for.
    features = ("bf16",) if model is None else ()
    features += ("sp",) if parsed.tp > 1 else ()
    errors = check(
        [parsed],
        modes=["token-mean", "group-seq-mean"],
        micro_batch_counts=[1, 3],
        features=features,
        model_cfg=default_moe_model() if model else None,
        timeout=300,
    )
    tolerance = BF16_TOLERANCE if "bf16" in features else TF32_TOLERANCE
    record(f"invariance_{layout}", {"worst": _worst(errors[layout]), "tolerance": tolerance})
    assert _worst(errors[layout]) < tolerance, errors[layout]
