"""What the trainer adds to an SGLang launch command for colocated engines."""

from __future__ import annotations

from megatron_grpo.rollout.engines import ColocatedEngines, with_flags
from megatron_grpo.rollout.servers import LaunchConfig, server_argv

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
