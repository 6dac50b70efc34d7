"""Context parallelism inside the loss contract: the CP row of check-invariance on GPUs.

CP=2 splits each sequence of a THD micro-batch over two ranks (Transformer Engine's ring
attention, chunks r and 2cp-1-r) and must give the single-process gradient of every loss
mode, in bf16 (TE splits attention only in its 16-bit backends) within BF16_TOLERANCE. It
needs one GPU per rank unless NCCL lets two ranks share a device (a probe decides; NCCL
refuses since 2.5). The loss side alone runs on CPU in
tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
from gpu_tier import layout_skip_reason, record

from megatron_grpo.commands.invariance import BF16_TOLERANCE, Layout, check
from megatron_grpo.config import MODES

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("layout", ["1x1x1x1x2", "2x1x1x1x2", "1x2x1x1x2"])
def test_context_parallel_row(layout, shared_device):
    parsed = Layout.parse(layout)
    reason = layout_skip_reason(parsed.world_size, shared_device)
    if reason:
        pytest.skip(reason)
    errors = check(
        [parsed],
        modes=list(MODES),
        micro_batch_counts=[1, 3],
        features=("bf16", "sp") if parsed.tp > 1 else ("bf16",),
        timeout=300,
    )
    worst = max(max(e.values()) for e in errors[str(parsed)].values())
    record(f"context_parallel_{layout}", {"worst": worst})
    assert worst < BF16_TOLERANCE, errors[str(parsed)]
