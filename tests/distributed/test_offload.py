"""The learner's offload to host memory (rollout.colocate.offload): what it frees, and that
training after a reload goes on bitwise as if nothing had moved.

Each launch trains two learners with the same weights on the same rollout batch for three
optimizer steps through ``train.step.train_on_rollout``; between steps one of them goes
through a colocated step's transitions: optimizer states and gradient buffers to host, the
weight export (which reads the parameters), the parameters to host, reload.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]

WORKERS = str(Path(__file__).with_name("workers_offload.py"))
STEPS = 3


@pytest.mark.parametrize(
    "tp, pp, dp, distributed",
    [(1, 1, 2, True), (2, 2, 1, False)],
    ids=["dp2-distributed-optimizer", "tp2xpp2-plain-optimizer"],
)
def test_offload_frees_the_device_and_training_goes_on_bitwise(tp, pp, dp, distributed):
    results = run_workers(
        f"{WORKERS}:offload_between_steps",
        tp * pp * dp,
        kwargs={"tp": tp, "pp": pp, "distributed": distributed, "steps": STEPS},
        timeout=360,
    )
    for rank, r in enumerate(results):
        assert r["mismatch"] == [], (rank, r["mismatch"])
        assert len(r["freed"]) == STEPS
        for freed in r["freed"]:
            first = freed["after_optimizer_and_grads"]
            assert first["optimizer"] == 0 and first["grads"] == 0, (rank, first)
            assert first["params"] > 0, "the parameters stay until the weights are pushed"
            assert freed["params_after_params"] == 0, (rank, freed)
            assert freed["offloaded"] == ("optimizer", "grads", "params")
            for refused in ("export_refused", "forward_refused"):
                assert freed[refused] and "offloaded to host" in freed[refused], (rank, freed)
        # counted before the first step (Adam's moments did not exist yet), held after it
        assert r["predicted_host_bytes"] == r["host_copy_bytes"] > 0, (rank, r)
        # on a CPU the learner's memory is host memory: no copy outlives the reload
        assert r["host_copy_bytes_after_reload"] == [0] * STEPS, (rank, r)
    assert max(f["exported_units"] for r in results for f in r["freed"]) > 0
