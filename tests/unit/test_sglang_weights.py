"""The trainer's ends of SGLang's weight transports, against stand-in receivers.

- The broadcast group: the receivers are separate processes that join
  through SGLang's ``WeightUpdater.init_weights_update_group`` and
  ``init_custom_process_group`` (a ``tcp://`` rendezvous, ``PrefixStore(group_name)``
  and torch's own process-group helper), at SGLang's rank offsets, and receive
  each tensor by broadcast.
- The tensor format: another process reads the payload with SGLang's
  ``MultiprocessingSerializer.deserialize`` (an allow-list of torch names,
  ``SafeUnpickler``) and sees the same tensors.

Both SGLang pieces are the stand-ins of ``sglang_standin.py``, against which
``sglang_api.compat``'s declared targets are checked too (test_internals.py).

The real SGLang server runs both in tests/sglang.
"""

from __future__ import annotations

import base64
import gc
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_grpo.launch import free_port
from megatron_grpo.sglang_api.update_group import dtype_name, open_update_group
from megatron_grpo.weight_sync.sglang_tensor import (
    serialize_for_sglang,
    sglang_tensor_payload,
    shared_copies,
)

pytestmark = pytest.mark.timeout(120)

STANDIN = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import sglang_standin"

RECEIVER = STANDIN + textwrap.dedent(
    """
    import json, os
    import torch

    sys.modules.update(sglang_standin.modules())
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    port, rank, world, name, shapes = json.loads(sys.argv[1])
    pg = WeightUpdater(tp_rank=0).init_weights_update_group(
        master_address="127.0.0.1", master_port=port, rank_offset=rank, world_size=world,
        group_name=name, backend="gloo",
    )
    sums = []
    for shape, dtype in shapes:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        pg.broadcast(t, 0).wait()
        sums.append(float(t.double().sum()))
    print(json.dumps(sums), flush=True)
    # A server keeps its group for life; this stand-in leaves at once, without tearing gloo
    # down at interpreter exit (which can abort while the sender still holds the store).
    os._exit(0)
    """
)

UNPICKLER = STANDIN + textwrap.dedent(
    """
    import json
    import torch

    sys.modules.update(sglang_standin.modules())
    from sglang.srt.utils.common import MultiprocessingSerializer

    out = []
    for entry in json.loads(sys.stdin.read()):
        pairs = MultiprocessingSerializer.deserialize(entry)
        out.append({n: [list(t.shape), str(t.dtype), float(t.double().sum())] for n, t in pairs})
        del pairs  # as a server does once loaded: the last reference frees the shared memory
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_broadcast_group_reaches_receivers_built_like_sglangs():
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).view(3, 4),
        "b": torch.full((5,), 0.5, dtype=torch.bfloat16),
        "c": torch.arange(7, dtype=torch.int64),
    }
    shapes = [[list(t.shape), dtype_name(t.dtype)] for t in tensors.values()]
    port, name, world = free_port(), "mgrpo_test_group", 3
    receivers = [
        subprocess.Popen(
            [sys.executable, "-c", RECEIVER, json.dumps([port, rank, world, name, shapes])],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 2)  # rank_offset 1 for the first server, as weight_sync assigns
    ]
    group = open_update_group(
        master_address="127.0.0.1",
        master_port=port,
        world_size=world,
        group_name=name,
        backend="gloo",
        timeout_s=60,
    )
    group.broadcast(list(tensors.values()))
    expected = [float(t.double().sum()) for t in tensors.values()]
    for receiver in receivers:
        out, _ = receiver.communicate(timeout=60)
        assert receiver.returncode == 0
        assert json.loads(out) == expected
    group.close()
    assert not dist.is_initialized()  # nothing registered with torch.distributed


@pytest.mark.slow
def test_tensor_payload_unpickles_elsewhere_with_a_torch_only_allow_list():
    named = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    shared = shared_copies(named)
    assert all(t.is_shared() for t in shared.values())
    payload = sglang_tensor_payload(shared, tp_size=2, weight_version="7")
    assert payload["weight_version"] == "7" and payload["flush_cache"] is True
    assert "load_format" not in payload  # SGLang's default loader (model.load_weights)
    entries = payload["serialized_named_tensors"]
    assert len(entries) == 2  # one per TP rank, each unpickled once by its rank
    done = subprocess.run(
        [sys.executable, "-c", UNPICKLER],
        input=json.dumps(entries),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    expected = {n: [list(t.shape), str(t.dtype), float(t.double().sum())] for n, t in named.items()}
    assert json.loads(done.stdout) == [expected, expected]
    names = [t.untyped_storage()._share_filename_cpu_()[1].decode() for t in shared.values()]
    del shared, payload, entries
    gc.collect()
    assert not [n for n in names if Path("/dev/shm", n.lstrip("/")).exists()]  # nothing leaks


def consume(entry: str) -> list:
    """Unpickle once, as the server's rank does (each pickle holds one reference)."""
    return pickle.loads(base64.b64decode(entry))


def test_only_handles_travel():
    big = shared_copies({"w": torch.zeros(256, 256)})
    entry = serialize_for_sglang(big)
    assert len(base64.b64decode(entry)) < 1024  # the data would be 256 KiB
    [(name, tensor)] = consume(entry)
    assert name == "w" and tensor.shape == (256, 256)


def test_sharing_strategy_is_restored():
    before = torch.multiprocessing.get_sharing_strategy()
    consume(serialize_for_sglang(shared_copies({"w": torch.ones(2)})))
    assert torch.multiprocessing.get_sharing_strategy() == before


def test_a_cuda_tensor_names_its_device_by_uuid_and_nothing_else_changes(monkeypatch):
    """What a CUDA tensor pickles as (torch's ``rebuild_cuda_tensor`` and its arguments) with
    the device index replaced by the device's UUID, as SGLang's own senders pickle it; a
    CPU tensor's reduction is left as it was. (The CUDA IPC path itself needs a GPU:
    tests/gpu/test_sglang_gpu.py.)"""
    from torch.multiprocessing import reductions

    from megatron_grpo.weight_sync import sglang_tensor as sglang_weights

    monkeypatch.setattr(sglang_weights, "_device_uuid", lambda index: f"GPU-uuid-of-{index}")
    args = tuple(range(15))
    rebuild, got = sglang_weights.device_as_uuid((reductions.rebuild_cuda_tensor, args))
    assert rebuild is reductions.rebuild_cuda_tensor
    assert got == (*range(6), "GPU-uuid-of-6", *range(7, 15))
    cpu = reductions.reduce_tensor(torch.ones(2))
    assert sglang_weights.device_as_uuid(cpu) is cpu


def test_sglang_on_a_gpu_takes_cuda_ipc_only_from_a_process_with_a_gpu(monkeypatch):
    from megatron_grpo.weight_sync import server_kinds
    from megatron_grpo.weight_sync.server_kinds import ServerKind

    on_gpu = ServerKind(embedded=False, tp_size=1, host=None, device="cuda")
    on_cpu = ServerKind(embedded=False, tp_size=1, host=None, device="cpu")
    monkeypatch.setattr(server_kinds, "_cuda_available", lambda: False)
    assert on_gpu.tensor_way() == on_cpu.tensor_way() == "sglang"
    monkeypatch.setattr(server_kinds, "_cuda_available", lambda: True)
    assert on_gpu.tensor_way() == "sglang_cuda" and on_cpu.tensor_way() == "sglang"
