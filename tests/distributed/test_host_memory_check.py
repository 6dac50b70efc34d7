"""The host-memory check before the learner's offload, collective over two ranks of one
node: their bytes are added up, and a node that cannot take them refuses on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.launch import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

HERE = Path(__file__)


def check(offload_bytes: int, headroom_gib: float) -> str | None:
    import torch.distributed as dist

    from megatron_grpo.train.host_memory import HostMemoryError, check_host_memory

    dist.init_process_group("gloo")
    try:
        check_host_memory(offload_bytes, ["optimizer", "grads"], headroom_gib, dist.group.WORLD)
    except HostMemoryError as err:
        return str(err)
    finally:
        dist.destroy_process_group()
    return None


def test_a_node_that_cannot_take_the_offload_refuses_on_every_rank():
    # the two ranks' 1 MiB fit any machine that runs this; a headroom of 1 PiB fits none
    fits = {"offload_bytes": 1 << 20, "headroom_gib": 0}
    assert run_workers(f"{HERE}:check", 2, kwargs=fits) == [None, None]
    refused = run_workers(
        f"{HERE}:check", 2, kwargs={"offload_bytes": 1 << 20, "headroom_gib": float(1 << 20)}
    )
    print(refused[0])
    assert refused[0] == refused[1] is not None
    assert "rank 0 1.0 MiB, rank 1 1.0 MiB" in refused[0]
    assert f"({2 << 20} bytes) together" in refused[0]
    assert "rollout.colocate.host_memory_headroom_gib=" in refused[0]
    assert "rollout.colocate.offload=['optimizer', 'grads']" in refused[0]
