"""Denominators: one all-reduce per global batch, on the DP group; the 2x4 vs 1x8 toy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.launch import run_workers

pytestmark = pytest.mark.distributed

WORKERS = str(Path(__file__).with_name("workers_loss.py"))


@pytest.fixture(scope="module")
def dp2_tp2_pp2():
    return run_workers(
        f"{WORKERS}:denominator_collectives", 8, kwargs={"tp": 2, "pp": 2}, timeout=300
    )


def test_exactly_one_all_reduce_on_the_dp_group(dp2_tp2_pp2):
    for r in dp2_tp2_pp2:
        if not r["last"]:
            assert r["calls"] == [], f"rank {r['rank']} (not the last stage) communicated"
            continue
        assert r["calls"] == [("all_reduce", r["dp_cp_ranks"])], r
        assert sorted(r["dp_cp_ranks"]) != sorted(r["tp_ranks"])
        assert sorted(r["dp_cp_ranks"]) != sorted(r["pp_ranks"])
        assert len(r["dp_cp_ranks"]) == 2  # DP only, never the whole world (8)


def test_weights_agree_with_the_single_process_computation(dp2_tp2_pp2):
    """Global weights seen from each DP rank equal those computed on the whole batch."""
    from megatron_grpo.algo.normalization import global_counts, sequence_weights
    from megatron_grpo.commands.invariance import GROUP_SIZES, MAX_COMPLETION, fixed_batch

    samples = fixed_batch(vocab_size=100)
    n = torch.tensor([float(s.num_loss_tokens) for s in samples])
    g = torch.tensor([s.group for s in samples])
    counts = global_counts(n, g, len(GROUP_SIZES), group=None)
    expected = sequence_weights("group-seq-mean", counts, n, g, max_len=MAX_COMPLETION)
    seen = {}
    for r in dp2_tp2_pp2:
        if r["last"]:
            for sid, w in zip(r["sample_ids"].tolist(), r["weights"].tolist()):
                seen.setdefault(sid, set()).add(w)
    assert sorted(seen) == list(range(len(samples)))
    assert max(r["num_micro_batches"] for r in dp2_tp2_pp2) > 1  # several micro-batches
    for sid, ws in seen.items():
        assert len(ws) == 1  # TP replicas agree
        assert ws.pop() == pytest.approx(float(expected[sid]), rel=1e-12)


def test_vocab_parallel_logprobs_match_log_softmax(dp2_tp2_pp2):
    for r in dp2_tp2_pp2:
        assert r["logp_err"] < 1e-5 and r["ent_err"] < 1e-5 and r["grad_err"] < 1e-5, r


def test_toy_two_ranks_of_four_equal_one_rank_of_eight():
    """Per-token loss 1: 2 DP ranks x 4 sequences and 1 rank x 8 give one loss and gradient."""
    one = run_workers(
        f"{WORKERS}:toy_constant_loss", 1, kwargs={"num_sequences_per_rank": 8}, timeout=120
    )
    two = run_workers(
        f"{WORKERS}:toy_constant_loss", 2, kwargs={"num_sequences_per_rank": 4}, timeout=120
    )
    assert two[0]["results"] == two[1]["results"]
    for mode, (loss, grad) in one[0]["results"].items():
        loss2, grad2 = two[0]["results"][mode]
        assert loss2 == pytest.approx(loss, rel=1e-6), mode
        assert grad2 == pytest.approx(grad, rel=1e-6), mode
        # every mode but Dr. GRPO is a mean of ones; Dr. GRPO is mean(n_i) / L = 4.5 / 8
        assert loss == pytest.approx(4.5 / 8 if mode == "seq-mean-token-sum-norm" else 1.0)
