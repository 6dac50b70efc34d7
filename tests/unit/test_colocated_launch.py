"""What the trainer adds to an SGLang launch command for colocated engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_grpo.rollout.engines import ColocatedEngines, with_flags
from megatron_grpo.rollout.servers import LaunchConfig, server_argv

HF_CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
LAUNCH = "python -m sglang.launch_server --model-path {model} --host {host} --port {port}"


def test_colocated_engines_get_the_memory_saver_their_share_and_their_gpus():
    engines = ColocatedEngines(num_engines=4, tp=2, mem_fraction_static=0.7)
    cfg = LaunchConfig(
        command=with_flags(LAUNCH, engines.flags()),
        num_servers=engines.num_engines,
        gpus_per_server=engines.tp,
        model="/ckpt",
        log_dir="logs",
    )
    argv = [server_argv(cfg, index, 30000 + index) for index in range(4)]
    assert argv[3] == [
        *"python -m sglang.launch_server --model-path /ckpt --host 127.0.0.1 --port 30003".split(),
        *"--enable-memory-saver --mem-fraction-static 0.7 --tp-size 2 --base-gpu-id 6".split(),
    ]
    assert [a[-1] for a in argv] == ["0", "2", "4", "6"]


def test_a_flag_the_command_has_is_kept_as_written():
    command = LAUNCH + " --mem-fraction-static=0.5 --enable-memory-saver"
    flags = ColocatedEngines(num_engines=8, tp=1, mem_fraction_static=0.7).flags()
    assert with_flags(command, flags) == command + " --tp-size 1 --base-gpu-id {base_gpu_id}"


class Device:
    total_memory = 80 * 2**30


def fake_node(monkeypatch, gpus: int) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Device())


def qwen3_8b():
    from megatron_grpo.config.hf import model_config_from_hf, read_hf_config

    return model_config_from_hf(read_hf_config(HF_CONFIGS / "qwen3_8b"))


def test_an_8b_on_eight_80gb_gpus_gets_eight_engines_of_one_gpu(monkeypatch):
    from megatron_grpo.config import ColocateConfig, RolloutConfig
    from megatron_grpo.rollout.engines import colocated_engines

    fake_node(monkeypatch, 8)
    cfg = RolloutConfig(placement="colocated")
    # bf16 weights 16.4 GB; half of 0.7 x 80 GiB is 28 GiB: TP 1
    assert colocated_engines(cfg, qwen3_8b()) == ColocatedEngines(8, 1, 0.7)
    # at 0.3 of the GPU, half the pool is 12 GiB: TP 2
    cfg = RolloutConfig(placement="colocated", colocate=ColocateConfig(mem_fraction_static=0.3))
    assert colocated_engines(cfg, qwen3_8b()) == ColocatedEngines(4, 2, 0.3)
    cfg = RolloutConfig(placement="colocated", colocate=ColocateConfig(engine_tp=16))
    with pytest.raises(ValueError, match="engine_tp=16 does not divide the 8 GPUs per node"):
        colocated_engines(cfg, qwen3_8b())


def test_launched_colocated_engines_need_gpus(monkeypatch):
    import torch

    from megatron_grpo.config import RolloutConfig
    from megatron_grpo.rollout.engines import colocated_engines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs the node's GPUs .none is visible here."):
        colocated_engines(RolloutConfig(placement="colocated"), qwen3_8b())
