"""The host-memory budget of the learner's offload, on hand-computed numbers."""

from __future__ import annotations

import pytest

from megatron_grpo.train.host_memory import (
    GIB,
    NodeShortfall,
    RankReport,
    available_bytes,
    refusal,
    shortfalls,
)


def reports(node: str, first_rank: int, offloads_gib: list[float], available_gib: float):
    return [
        RankReport(first_rank + i, node, int(b * GIB), int(available_gib * GIB))
        for i, b in enumerate(offloads_gib)
    ]


def test_the_ranks_of_a_node_are_added_up_against_its_memory_less_the_headroom():
    # node a: 4 x 10 GiB = 40 GiB against 60 - 8 = 52: fits.
    # node b: 4 x 14 GiB = 56 GiB against 60 - 8 = 52: 4 GiB short (each rank alone fits).
    every = reports("a", 0, [10] * 4, 60) + reports("b", 4, [14] * 4, 60)
    [short] = shortfalls(every, headroom_bytes=8 * GIB)
    assert short.node == "b"
    assert short.per_rank == {4: 14 * GIB, 5: 14 * GIB, 6: 14 * GIB, 7: 14 * GIB}
    assert short.needed_bytes == 56 * GIB
    assert short.available_bytes == 60 * GIB
    assert shortfalls(every, headroom_bytes=4 * GIB) == []  # 56 <= 60 - 4


def test_a_node_takes_the_least_memory_any_of_its_ranks_saw():
    # 2 x 10 GiB = 20 GiB; the ranks read 30 and 21 GiB; 21 - 2 = 19 < 20: refused.
    every = reports("a", 0, [10], 30) + reports("a", 1, [10], 21)
    [short] = shortfalls(every, headroom_bytes=2 * GIB)
    assert short.available_bytes == 21 * GIB
    assert shortfalls(every, headroom_bytes=1 * GIB) == []  # 21 - 1 = 20: exactly fits


def test_the_refusal_names_the_node_the_bytes_and_the_keys():
    short = NodeShortfall("node-7", {4: 14 * GIB, 5: 14 * GIB}, 30 * GIB, 8 * GIB)
    message = refusal(short, ["optimizer", "grads", "params"])
    print(message)
    assert "node node-7" in message
    assert "rank 4 14.00 GiB, rank 5 14.00 GiB" in message
    assert f"28.00 GiB ({28 * GIB} bytes) together" in message
    assert "30.00 GiB available" in message and "leaves at 22.00 GiB" in message
    assert "rollout.colocate.offload=['optimizer', 'grads', 'params']" in message
    assert "rollout.colocate.host_memory_headroom_gib=8" in message


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    512 kB\n")
    assert available_bytes(str(meminfo)) == 512 * 1024
    meminfo.write_text("MemTotal:       1000 kB\n")
    with pytest.raises(RuntimeError, match="no MemAvailable"):
        available_bytes(str(meminfo))
    assert available_bytes() > 0  # this machine's
