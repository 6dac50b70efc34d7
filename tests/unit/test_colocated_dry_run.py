"""The colocated placement's dry run: engine TP, both phases per GPU and the offload's host memory
by hand, the colocated recipes at their lengths, and the refusals (exit 2)."""

import subprocess

import pytest
from test_recipes import EXAMPLES, HF_CONFIGS, clean_env, recorded_dry_run, run_cli

from megatron_grpo.commands.colocated_memory import (
    ENGINE_RUNTIME_GIB,
    check_engine_tp,
    colocated_memory,
    default_engine_tp,
    engine_weight_bytes,
    learner_resident,
    offloaded_bytes,
)
from megatron_grpo.commands.memory_model import GIB, RESERVED_GIB, StageMemory

# Colocated recipe -> the disaggregated recipe whose model (HF config fixture) it shares.
COLOCATED = {"qwen3_8b_colocated": "qwen3_8b", "qwen3_30b_a3b_colocated": "qwen3_30b_a3b"}


def stage(weights=10, grads=20, optimizer=15, reference=0, activations=3, logits=4) -> StageMemory:
    """A learner's peak stage, in GiB: 57 with the 5 reserved and no reference model."""
    return StageMemory(
        stage=0,
        weights=weights * GIB,
        gradients=grads * GIB,
        optimizer=optimizer * GIB,
        reference=reference * GIB,
        activations=activations * GIB,
        logits=logits * GIB,
        reserved=RESERVED_GIB * GIB,
        layers_in_flight=1,
    )


def plan(**kw):
    args = dict(
        offload=["optimizer", "grads"],
        mem_fraction_static=0.5,
        engine_tp=None,
        host_headroom_gib=8,
        num_params=8 * GIB,  # 16 GiB of bf16 weights
        stages=[stage()],
        gpus_per_node=8,
        gpu_memory_gib=80,
        host_memory_gib=2048,
    )
    return colocated_memory(**{**args, **kw})


# --------------------------------------------------------------------------- engine TP


def test_default_engine_tp_is_the_smallest_whose_shard_takes_half_the_pool():
    pool = 0.7 * 80 * GIB  # 56 GiB: a shard may take 28
    assert default_engine_tp(16 * GIB, 8, pool) == 1
    assert default_engine_tp(28 * GIB, 8, pool) == 1  # exactly half
    assert default_engine_tp(29 * GIB, 8, pool) == 2  # 14.5
    assert default_engine_tp(60 * GIB, 8, pool) == 4  # 60 / 2 = 30 > 28; 60 / 4 = 15
    # Qwen3-8B on 80 GiB: 8,190,735,360 x 2 B = 15.3 GiB; Qwen3-30B-A3B on 141 GiB:
    # 30,532,122,624 x 2 B = 56.9 GiB > 0.7 x 141 / 2 = 49.35, its half 28.4 is not.
    assert default_engine_tp(engine_weight_bytes(8_190_735_360), 8, pool) == 1
    assert default_engine_tp(engine_weight_bytes(30_532_122_624), 8, 0.7 * 141 * GIB) == 2


def test_an_engine_that_fits_no_tp_of_the_node_is_refused_by_name():
    with pytest.raises(ValueError, match=r"at engine TP 8 \(the most that divides 8 GPUs") as e:
        default_engine_tp(500 * GIB, 8, 56 * GIB)  # 62.5 GiB a shard at TP8, above 28
    assert "62.5 GiB, more than half of its static pool (56.0 GiB" in str(e.value)
    # 6 GPUs: the powers of two that divide it are 1 and 2
    with pytest.raises(ValueError, match="at engine TP 2 .the most that divides 6 GPUs"):
        default_engine_tp(60 * GIB, 6, 56 * GIB)


def test_a_configured_engine_tp_must_divide_the_node_and_leave_a_kv_cache():
    check_engine_tp(1, 40 * GIB, 8, 56 * GIB)  # above half the pool, but set by hand: allowed
    with pytest.raises(ValueError, match="engine_tp=16 does not divide the 8 GPUs per node"):
        check_engine_tp(16, 40 * GIB, 8, 56 * GIB)
    with pytest.raises(ValueError, match="at engine_tp=1 its weight shard is 60.0 GiB"):
        check_engine_tp(1, 60 * GIB, 8, 56 * GIB)


# --------------------------------------------------------------------------- phases by hand


def test_learner_keeps_what_is_not_offloaded_and_its_reserve():
    s = stage()
    assert learner_resident(s, ["optimizer", "grads"]) == {"params": 10 * GIB, "reserved": 5 * GIB}
    assert learner_resident(s, ["optimizer", "grads", "params"]) == {"reserved": 5 * GIB}
    assert sum(learner_resident(s, []).values()) == (10 + 20 + 15 + 5) * GIB
    assert learner_resident(stage(reference=10), ["params"])["reference"] == 10 * GIB
    assert offloaded_bytes(s, ["optimizer", "grads"]) == 35 * GIB
    assert offloaded_bytes(s, ["params"]) == 10 * GIB


def test_both_phases_and_host_memory_by_hand():
    p = plan()
    assert ENGINE_RUNTIME_GIB == 2.0
    # 16 GiB of weights, pool 0.5 x 80 = 40, a shard may take 20: TP1, 8 engines a node
    assert (p.engine_tp, p.engines_per_node, p.engine_weights) == (1, 8, 16 * GIB)
    # training: the peak 10 + 20 + 15 + 3 + 4 + 5 = 57, + the asleep engine's 2
    assert p.training_phase == 59 * GIB
    # rollout: pool 40 + engine runtime 2 + params 10 + reserved 5
    assert p.rollout_phase == 57 * GIB
    # host: (15 + 20) GiB a rank x 8 ranks + 8 headroom
    assert p.host_need == 288 * GIB
    assert p.fits and p.shortfalls() == []


def test_the_largest_stage_sets_each_figure():
    p = plan(stages=[stage(weights=10, logits=0), stage(weights=12, optimizer=10)])
    assert p.learner_peak == (12 + 20 + 10 + 3 + 4 + 5) * GIB
    assert sum(p.resident.values()) == (12 + 5) * GIB
    assert p.offloaded_per_rank == 35 * GIB  # the first stage's 20 + 15


def test_each_phase_that_does_not_fit_is_named_with_by_how_much():
    (rollout,) = plan(mem_fraction_static=0.9).shortfalls()
    # 72 + 2 + 10 + 5 = 89 of 80; at most (80 - 2 - 15) / 80 = 0.7875 fits
    assert rollout.startswith("the rollout phase does not fit: 89.0 GiB per GPU")
    assert "9.0 GiB above the GPU's 80.0" in rollout
    assert "mem_fraction_static (now 0.9; at most 0.79 fits" in rollout
    assert "add params to rollout.colocate.offload (10.0 GiB per GPU)" in rollout
    (training,) = plan(gpu_memory_gib=58, mem_fraction_static=0.1).shortfalls()
    assert training.startswith("the training phase does not fit: 59.0 GiB per GPU")
    assert "1.0 GiB above the GPU's 58.0" in training
    (host,) = plan(host_memory_gib=200).shortfalls()
    assert host.startswith("the offload does not fit in host memory: 288.0 GiB per node")
    assert "35.0 GiB of optimizer, grads per rank x 8 ranks" in host
    assert "88.0 GiB above --host-memory-gib 200.0" in host


# --------------------------------------------------------------------------- the recipes


@pytest.mark.parametrize(
    "recipe, gpu, phases",
    [
        # training 51.4 + 2; rollout 0.7 x 80 + 2 + params 7.6 + reserved 5;
        # host (11.4 + 15.3) x 8 + 8
        ("qwen3_8b_colocated", 80, ("8 engines per node x engine TP 1", "53.4", "70.6", "221.6")),
        # training 76.0 + 2; rollout 0.7 x 141 + 2 + 7.5 + 5; host (42.7 + 15.0) x 8 + 8
        (
            "qwen3_30b_a3b_colocated",
            141,
            ("4 engines per node x engine TP 2", "78.0", "113.2", "469.4"),
        ),
    ],
)
def test_colocated_recipe_fits_its_node_at_the_recipes_lengths(
    recipe, gpu, phases, tmp_path, capsys
):
    argv = recorded_dry_run(tmp_path, recipe, HF_DIR=str(HF_CONFIGS / COLOCATED[recipe]))
    assert argv[:8] == ["train", "--dry-run", "--nnodes", "1", "--gpus-per-node", "8"] + [
        "--gpu-memory-gb",
        str(gpu),
    ]
    assert "rollout.max_new_tokens=7168" in argv and "data.max_prompt_length=1024" in argv
    launch = next(a for a in argv if a.startswith("rollout.engines.launch_command="))
    assert "--enable-memory-saver --mem-fraction-static 0.7" in launch
    assert "rollout.colocate.mem_fraction_static=0.7" in argv
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    layout, training, rollout, host = phases
    assert f"colocated: {layout}; offloaded while the engines generate: optimizer, grads" in out
    assert f"training {training}, rollout {rollout} of {gpu:.1f} GiB per GPU; " in out
    assert f"host {host} of 2048.0 GiB per node" in out
    assert "verdict: fits" in out


def test_colocated_recipe_with_too_large_an_engine_share_is_refused(tmp_path, capsys):
    argv = recorded_dry_run(
        tmp_path,
        "qwen3_8b_colocated",
        "--set",
        "rollout.colocate.mem_fraction_static=0.9",
        HF_DIR=str(HF_CONFIGS / "qwen3_8b"),
    )
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert "verdict: DOES NOT FIT" in out
    # 0.9 x 80 + 2 + 7.6 + 5 = 86.6
    assert "error: the rollout phase does not fit: 86.6 GiB per GPU" in err
    assert "the training phase" not in err


def test_colocated_recipe_without_the_host_memory_is_refused(tmp_path, capsys):
    argv = recorded_dry_run(
        tmp_path, "qwen3_8b_colocated", HF_DIR=str(HF_CONFIGS / "qwen3_8b"), HOST_MEMORY_GIB="128"
    )
    assert argv[argv.index("--host-memory-gib") + 1] == "128"
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert "error: the offload does not fit in host memory: 221.6 GiB per node" in err
    assert "93.6 GiB above --host-memory-gib 128.0" in err


def test_colocated_engine_that_fits_no_tp_is_refused_by_name(tmp_path, capsys):
    argv = recorded_dry_run(
        tmp_path,
        "qwen3_8b_colocated",
        "--set",
        "rollout.colocate.engine_tp=null",
        "--set",
        "rollout.colocate.mem_fraction_static=0.1",
        HF_DIR=str(HF_CONFIGS / "qwen3_8b"),
        GPU_MEMORY_GB="24",
    )
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    # 15.3 GiB / 8 = 1.9 GiB a shard, above half of 0.1 x 24 = 2.4 GiB
    assert "rollout.colocate: the engine does not fit: at engine TP 8" in err
    assert "1.9 GiB, more than half of its static pool (2.4 GiB" in err


def test_disaggregated_recipe_prints_no_colocated_phases(tmp_path, capsys):
    code, out, _ = run_cli(recorded_dry_run(tmp_path, "qwen3_8b"), capsys)
    assert code == 0
    assert "colocated:" not in out and "phase" not in out
    assert "verdict: fits (51.4 of 80 GiB per GPU)" in out


def test_colocated_recipe_has_no_rollout_hosts():
    done = subprocess.run(
        ["bash", str(EXAMPLES / "run_grpo_qwen3_8b_colocated.sh"), "--rollout"],
        env=clean_env(HF_DIR=str(HF_CONFIGS / "qwen3_8b")),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "the trainer starts its engines on the training GPUs" in done.stderr
