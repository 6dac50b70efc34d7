"""Foundation acceptance: layouts agree on logits, training learns, checkpoints reshard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_grpo.launch import WorkerError, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKERS = str(Path(__file__).with_name("workers_foundation.py"))


def last_stage_logits(results: list[dict]) -> torch.Tensor:
    return next(r["logits"] for r in results if r["logits"] is not None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    (result,) = run_workers(f"{WORKERS}:save_reference", 1, kwargs={"ckpt": str(ckpt)}, timeout=180)
    return ckpt, result["logits"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_logits_match_single_process(reference, tp, pp):
    ckpt, expected = reference
    results = run_workers(
        f"{WORKERS}:load_and_forward",
        tp * pp,
        kwargs={"tp": tp, "pp": pp, "ckpt": str(ckpt)},
        timeout=240,
    )
    got = last_stage_logits(results)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_training_dp2_tp2_pp2_lowers_loss_and_checkpoint_reshards(tmp_path):
    ckpt = tmp_path / "tp2pp2"
    results = run_workers(
        f"{WORKERS}:train_steps",
        8,
        kwargs={"tp": 2, "pp": 2, "steps": 4, "ckpt": str(ckpt)},
        timeout=400,
    )
    losses = next(r["losses"] for r in results if r["last"])
    assert losses[-1] < losses[0] - 0.5, losses
    # The same loss on every last-stage rank (DP and TP replicas agree).
    assert all(r["losses"] == losses for r in results if r["last"])

    # Saved at TP2 x PP2, loaded at TP1 x PP4: identical logits.
    loaded = run_workers(
        f"{WORKERS}:load_and_forward", 4, kwargs={"tp": 1, "pp": 4, "ckpt": str(ckpt)}, timeout=240
    )
    torch.testing.assert_close(
        last_stage_logits(loaded), last_stage_logits(results), rtol=0, atol=1e-5
    )


def test_bad_layout_fails_at_start_with_named_cause():
    with pytest.raises(WorkerError, match=r"world size 3 is not divisible by TP\(2\)"):
        run_workers(
            f"{WORKERS}:load_and_forward", 3, kwargs={"tp": 2, "pp": 1, "ckpt": "x"}, timeout=120
        )
