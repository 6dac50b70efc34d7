"""Fixtures of the GPU tier: whether a GPU may host two ranks, SGLang's own environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gpu_tier import IN_TIER, SGLANG_VENV, WORKERS, record, recorded


@pytest.fixture(scope="session")
def shared_device() -> dict[str, Any]:
    """Whether NCCL lets two ranks share cuda:0 here: a probe of 2 processes, one all-reduce.
    NCCL refuses it since 2.5 ("Duplicate GPU detected", ncclInvalidUsage)."""
    from megatron_grpo.launch import WorkerError, run_workers

    known = recorded("nccl_two_ranks_one_gpu")  # probed by an earlier part of this run
    if known is not None:
        return known
    try:
        [result, _] = run_workers(f"{WORKERS}:nccl_probe", 2, timeout=120)
        probe = {"allowed": True, "nccl": result["nccl"], "message": "NCCL allowed it"}
    except WorkerError as err:
        lines = [x for x in str(err).splitlines() if "Duplicate GPU" in x or "NCCL" in x]
        probe = {"allowed": False, "message": (lines[-1] if lines else str(err)[-300:]).strip()}
    record("nccl_two_ranks_one_gpu", probe)
    return probe


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    python = Path(os.environ.get("SGLANG_PYTHON", SGLANG_VENV / "bin" / "python"))
    if not python.exists():
        message = f"no SGLang GPU environment at {python}: bash scripts/test_gpu.sh sets it up"
        if IN_TIER:
            pytest.fail(message)
        pytest.skip(message)
    return python
