"""The CPU device layer (``device`` for torch, ``compat`` for megatron-core), checked in a
child process (it patches torch globally)."""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive on GPUs")

PROBE = r"""
import torch
from megatron_grpo.mcore import compat
compat.install()
compat.install()  # idempotent
x = torch.zeros(3, device="cuda")
assert x.device.type == "cpu", x.device
assert torch.ones(2).cuda().device.type == "cpu"
assert torch.ones(2).to("cuda").device.type == "cpu"
assert torch.ones(2).to(device="cuda:0").device.type == "cpu"
assert torch.ones(2).type() == "torch.cuda.FloatTensor"
assert torch.ones(2).type(torch.float64).dtype == torch.float64
assert torch.cuda.current_device() == torch.device("cpu")
torch.cuda.synchronize()
torch.cuda.manual_seed(3)
a = torch.rand(2)
torch.cuda.manual_seed(3)
assert torch.equal(a, torch.rand(2))
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
tracker = get_cuda_rng_tracker()
tracker.add("model-parallel-rng", 11)
before = torch.get_rng_state()
with tracker.fork():
    inside = torch.rand(2)
assert torch.equal(torch.get_rng_state(), before)  # fork restores the default generator
from megatron.core.transformer.utils import get_default_causal_mask
assert get_default_causal_mask(4).device.type == "cpu"
# the MoE layer's stand-ins: side streams and events, split sizes as numpy, no TE gemm
from megatron.core.transformer.moe import moe_utils, token_dispatcher
assert moe_utils.te_general_gemm is None
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    pass
side.record_event().synchronize()
splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 1]), as_numpy=True)
assert not torch.is_tensor(splits) and splits.tolist() == [2, 1]
assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3])))
print("ok")
"""


def test_device_layer_routes_cuda_to_cpu():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_backend_choice():
    from megatron_grpo.mcore import device

    assert device.distributed_backend() == "gloo"
    assert device.compute_device() == torch.device("cpu")
