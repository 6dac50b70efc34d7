"""What the GPU tier's tests share: where their figures go, and whether a layout's ranks fit
this machine's GPUs. Nothing here needs CUDA to be imported (the tier is collected, and
skipped, on machines without a GPU)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
WORKERS = str(Path(__file__).with_name("gpu_workers.py"))
SGLANG_VENV = Path(os.environ.get("SGLANG_GPU_VENV", ROOT / ".venv-sglang-gpu"))
IN_TIER = os.environ.get("MGRPO_GPU_TIER") == "1"
"""Set by scripts/test_gpu.sh: then a missing piece of the set-up fails a test, never skips it."""


def record(section: str, values: dict[str, Any]) -> None:
    """Add ``values`` under ``section`` of the tier's results file (``MGRPO_GPU_RESULTS``), which
    bench/gpu_report.py writes into docs/benchmarks.md; nothing without the variable."""
    path = os.environ.get("MGRPO_GPU_RESULTS")
    if not path:
        return
    out = Path(path)
    data = json.loads(out.read_text()) if out.exists() else {}
    data[section] = {**values, "recorded": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")


def recorded(section: str) -> dict[str, Any] | None:
    """What an earlier test of this tier run recorded under ``section``, or None."""
    path = os.environ.get("MGRPO_GPU_RESULTS")
    if not path or not Path(path).exists():
        return None
    return json.loads(Path(path).read_text()).get(section)


def layout_skip_reason(world_size: int, shared: dict[str, Any]) -> str | None:
    """Why a layout of ``world_size`` ranks cannot run on this machine's GPUs, or None."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size or shared["allowed"]:
        return None
    return (
        f"needs {world_size} GPUs, one per rank: this machine has {gpus}, and two ranks on one "
        f"device were refused by NCCL in a probe here ({shared['message']}); gloo is no "
        "substitute, megatron-core's collectives on CUDA tensors need NCCL"
    )
