"""megatron-core's MoE layer (alltoall dispatcher, SequentialMLP) on gloo: expert
parallelism over DP and over TP ranks gives the single-process gradient, and the
full-state gather and load name experts by their global index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKERS = str(Path(__file__).with_name("workers_moe.py"))
TOLERANCE = 1e-5


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    scale = max(float(t.abs().max()) for t in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


@pytest.fixture(scope="module")
def reference() -> dict:
    (result,) = run_workers(f"{WORKERS}:gradients", 1, timeout=180)
    return result


def test_full_state_names_every_expert_once(reference):
    from megatron_grpo.convert.weights import canonical_megatron_name

    names = {canonical_megatron_name(k) for k in reference["init"]}
    experts = [n for n in names if ".mlp.experts.local_experts." in n]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert reference["init"]["decoder.layers.0.mlp.router.weight"].shape == (4, 64)
    assert not any(".mlp.linear_fc" in n for n in names)  # no dense MLP left


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2)], ids=["2x1x1x2", "1x2x1x2"])
def test_expert_parallel_gradient_matches_single_process(reference, tp, ep):
    results = run_workers(
        f"{WORKERS}:gradients",
        2,
        kwargs={"tp": tp, "ep": ep, "init": reference["init"]},
        timeout=240,
    )
    assert sorted(r["ep_rank"] for r in results) == [0, 1]
    got = results[0]
    assert torch.equal(  # loaded by global expert index, gathered back to the same names
        got["params"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"],
        reference["init"]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"],
    )
    assert relative_error(got["params"], reference["init"]) == 0.0
    error = relative_error(got["grads"], reference["grads"])
    print(f"TP{tp} x EP{ep}: max |dg| / max |g| = {error:.2e}")
    assert error < TOLERANCE
    assert max(got["spread"].values()) < TOLERANCE * max(
        float(t.abs().max()) for t in got["grads"].values()
    )
    # the balance loss and the busiest expert's load are those of the whole batch
    want = reference["metrics"]
    assert got["metrics"]["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=1e-6)
    assert got["metrics"]["moe_max_load"] == want["moe_max_load"]


def test_balance_metrics_count_every_routed_token(reference):
    """4 rows of 12 tokens, top-2: 96 expert slots per layer; the loss is near 1 (even)."""
    loads = reference["loads"]
    assert loads.shape == (2, 4) and loads.sum(dim=1).tolist() == [96.0, 96.0]
    metrics = reference["metrics"]
    assert metrics["moe_max_load"] == float((loads.max(dim=1).values / 24).max()) >= 1.0
    # two layers, each sum_s E sum_i f_si P_si / 4 sequences x coeff 0.01, about 1 each
    assert 0.01 < metrics["moe_aux_loss"] < 0.04
