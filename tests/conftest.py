import pytest
import torch


def gpu_skip_reason() -> str | None:
    """Why tests marked ``gpu`` cannot run here (None when a CUDA device is present)."""
    if torch.cuda.is_available():
        return None
    build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    return (
        f"needs an NVIDIA CUDA GPU: torch.cuda.is_available() is False on this machine "
        f"(torch {torch.__version__}, {build}); the GPU tier runs with bash scripts/test_gpu.sh"
    )


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip_gpu = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
