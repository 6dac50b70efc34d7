"""Context parallelism inside the loss contract, on CPU: what runs after the logits.

Attention split over CP ranks is Transformer Engine's (tests/gpu/test_context_parallel.py
checks the whole model on a GPU). Here 2 gloo ranks each hold their CP share of one THD
micro-batch (every loss mode, the sequence-level ratio and importance weights included)
and must give, summed, the loss and the gradient of the whole micro-batch on one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.config import MODES
from megatron_grpo.launch import run_workers

pytestmark = pytest.mark.distributed

WORKERS = str(Path(__file__).with_name("workers_cp.py"))


@pytest.fixture(scope="module")
def cp2():
    [result, _] = run_workers(f"{WORKERS}:cp_loss", 2, kwargs={"modes": list(MODES)}, timeout=300)
    return result


def test_the_two_shares_cover_every_position_once(cp2):
    assert cp2["covered"] == list(range(cp2["positions"]))


@pytest.mark.parametrize("mode", MODES)
def test_shares_sum_to_the_loss_and_gradient_of_the_whole_micro_batch(cp2, mode):
    r = cp2["modes"][mode]
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6, abs=1e-9)
    scale = float(r["ref_grad"].abs().max())
    assert scale > 0
    assert float((r["grad"] - r["ref_grad"]).abs().max()) / scale < 1e-6
    assert r["tokens"] == r["ref_tokens"] and r["clipped"] == r["ref_clipped"]
    for weights in r["weights"]:  # whole-sequence counts on every CP rank, counted once
        torch.testing.assert_close(weights, r["ref_weights"], rtol=1e-12, atol=0)


def test_some_mode_uses_the_sequence_level_terms_that_need_the_cp_sum():
    from megatron_grpo.commands.invariance.cases import default_loss

    levels = {(default_loss(m).ratio_level, default_loss(m).tis_level) for m in MODES}
    assert ("sequence", "sequence") in levels and ("token", "token") in levels


def test_a_cp_layout_in_float32_is_refused_before_any_process_starts():
    """Transformer Engine splits attention over CP ranks only in 16-bit (fused, flash)."""
    from megatron_grpo.commands.invariance import Layout, check

    with pytest.raises(ValueError, match="needs --features bf16"):
        check([Layout(1, 1, 1, cp=2)], modes=["token-mean"], micro_batch_counts=[1])
