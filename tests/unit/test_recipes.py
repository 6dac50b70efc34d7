"""The recipes: run scripts that take the model from its Hugging Face directory.

Each run script is run by bash with a stand-in ``megatron-grpo`` (or ``torchrun``) on PATH
that records its arguments; the recorded command is then run in this process (one torch
import for all recipes). The HF directory of every recipe is a fixture that holds only the
model's config.json (tests/fixtures/hf_configs/<recipe>/). One recipe also runs end to end
through the real command.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from megatron_grpo import cli
from megatron_grpo.commands.dry_run import dry_run, resolve_world_size
from megatron_grpo.config import dump_config, load_config
from megatron_grpo.config.hf import check_family, family_of, get_family, read_hf_config
from megatron_grpo.config.init_model import MODEL_CONFIG_FILE
from megatron_grpo.config.param_count import total_params

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HF_CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
MODELS = {
    "qwen3_0.6b": "qwen3",
    "qwen3_1.7b": "qwen3",
    "qwen3_4b": "qwen3",
    "qwen3_8b": "qwen3",
    "qwen3_14b": "qwen3",
    "qwen3_32b": "qwen3",
    "qwen3_30b_a3b": "qwen3_moe",
    "qwen3_235b_a22b": "qwen3_moe",
    "qwen2.5_7b": "qwen2",
    "qwen2.5_32b": "qwen2",
    "qwen2.5_72b": "qwen2",
    "llama3.1_8b": "llama",
    "llama3.1_70b": "llama",
}
COLOCATED = ("qwen3_8b_colocated", "qwen3_30b_a3b_colocated")
"""Colocated variants of recipes in MODELS (tests/unit/test_colocated_dry_run.py)."""
LAYOUT_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE")


class Figures(NamedTuple):
    total_params: int
    params_per_gpu: tuple[int, ...]
    """Per pipeline stage."""
    memory_per_gpu: tuple[int, ...]
    """Per pipeline stage, bytes (rounded)."""


# The dry-run figures of every recipe at its own world size with the architecture written out
# by hand, as --set model.* overrides of each number in the model's config.json on the Hub.
HAND_WRITTEN = {
    "qwen3_0.6b": Figures(
        596_049_920,
        (596_049_920,),
        (42_592_403_456,),
    ),
    "qwen3_1.7b": Figures(
        1_720_574_976,
        (1_720_574_976,),
        (57_133_248_000,),
    ),
    "qwen3_4b": Figures(
        4_022_468_096,
        (2_011_495_936,),
        (50_858_880_512,),
    ),
    "qwen3_8b": Figures(
        8_190_735_360,
        (4_096_046_080,),
        (55_215_019_008,),
    ),
    "qwen3_14b": Figures(
        14_768_307_200,
        (3_692_723_200,),
        (56_499_556_352,),
    ),
    "qwen3_32b": Figures(
        32_762_123_264,
        (4_096_676_864,),
        (58_268_315_648,),
    ),
    # Mixture of experts: the totals are transformers' Qwen3MoeForCausalLM parameter counts;
    # a GPU holds num_experts / EP whole experts of each of its layers.
    "qwen3_30b_a3b": Figures(
        30_532_122_624,
        (4_018_878_464,),
        (81_647_017_984,),  # 76.0 GiB: the recipe's GPUs have 141 GB
    ),
    "qwen3_235b_a22b": Figures(
        235_093_634_560,
        (4_566_945_536, 4_566_949_632),
        (56_995_669_312, 61_812_855_104),
    ),
    "qwen2.5_7b": Figures(
        7_615_616_512,
        (3_807_910_400,),
        (52_323_936_768,),
    ),
    "qwen2.5_32b": Figures(
        32_763_876_352,
        (4_096_717_824,),
        (58_249_834_496,),
    ),
    "qwen2.5_72b": Figures(
        72_706_203_648,
        (4_545_234_944, 4_545_243_136),
        (61_540_491_264, 63_681_781_760),
    ),
    "llama3.1_8b": Figures(
        8_030_261_248,
        (4_015_263_744,),
        (52_606_832_640,),
    ),
    "llama3.1_70b": Figures(
        70_553_706_496,
        (4_410_966_016, 4_410_974_208),
        (59_923_759_104, 61_630_939_136),
    ),
}


# The hand-written numbers that do not change the figures, shared by each family's models:
# (max_position_embeddings, rotary_base, rope_scaling_factor, norm_epsilon).
HAND_WRITTEN_ROPE_AND_NORM = {
    "qwen3": (40960, 1e6, None, 1e-6),
    "qwen3_moe": (40960, 1e6, None, 1e-6),
    "qwen2": (32768, 1e6, None, 1e-6),
    "llama": (131072, 5e5, 8.0, 1e-5),
}


def clean_env(shims: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment without layout variables; on PATH, ``shims`` first, then the running
    interpreter's scripts (``megatron-grpo``, ``torchrun``), active venv or not."""
    env = {k: v for k, v in os.environ.items() if k not in LAYOUT_VARS}
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    return {**env, "PATH": path if shims is None else f"{shims}:{path}", **extra}


def recording(tmp_path: Path, command: str) -> Path:
    """A stand-in ``command`` on PATH in ``tmp_path`` that writes its arguments to ``args``."""
    shim = tmp_path / command
    shim.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGS_OUT"\n')
    shim.chmod(0o755)
    return tmp_path / "args"


def run_script(tmp_path: Path, recipe: str, *args: str, **env: str) -> list[str]:
    """Run ``run_grpo_<recipe>.sh`` with the recipe's HF directory; the recorded arguments."""
    out = recording(tmp_path, "megatron-grpo" if "--dry-run" in args else "torchrun")
    env = {"HF_DIR": str(HF_CONFIGS / recipe), **env}
    subprocess.run(
        ["bash", str(EXAMPLES / f"run_grpo_{recipe}.sh"), *args],
        env=clean_env(tmp_path, ARGS_OUT=str(out), **env),
        check=True,
    )
    return out.read_text().split("\0")[:-1]


def recorded_dry_run(tmp_path: Path, recipe: str, *args: str, **env: str) -> list[str]:
    """The megatron-grpo arguments ``run_grpo_<recipe>.sh --dry-run`` passes."""
    return run_script(tmp_path, recipe, "--dry-run", *args, **env)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the scripts pass paths relative to the repository root
    try:
        code = cli.main(argv)
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def load_train_config(argv: list[str]):
    args = cli.build_parser().parse_args(argv)
    return args, load_config(args.config, args.overrides)


def test_every_model_has_a_run_script_and_an_hf_config():
    scripts = sorted(p.stem.removeprefix("run_grpo_") for p in EXAMPLES.glob("run_grpo_*.sh"))
    assert scripts == sorted([*MODELS, *COLOCATED, "cpu_tiny"])
    assert sorted(p.name for p in HF_CONFIGS.iterdir()) == sorted(MODELS)
    assert not (EXAMPLES / "models").exists()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_config_fixture_is_a_real_config_of_its_family(name):
    hf_config = read_hf_config(HF_CONFIGS / name)
    family = get_family(MODELS[name])
    assert hf_config["architectures"] == [family.architecture]
    assert hf_config["model_type"] == family.model_type
    assert family_of(hf_config) == family
    m = load_config(None, [f"train.init={HF_CONFIGS / name}"]).model
    assert m.hf_family == MODELS[name]
    check_family(m, family)
    rope_and_norm = (m.max_position_embeddings, m.rotary_base, m.rope_scaling_factor)
    assert rope_and_norm + (m.norm_epsilon,) == HAND_WRITTEN_ROPE_AND_NORM[MODELS[name]]


@pytest.mark.parametrize("recipe", sorted(MODELS))
def test_recipe_dry_run_gives_the_hand_written_figures(recipe, tmp_path, capsys):
    script = (EXAMPLES / f"run_grpo_{recipe}.sh").read_text()
    assert "model.num_layers" not in script and "MODEL_ARGS" not in script
    nodes = int(re.search(r"TRAIN_NODES=(\d+)", script).group(1))
    argv = recorded_dry_run(tmp_path, recipe)
    assert argv[:6] == ["train", "--dry-run", "--nnodes", str(nodes), "--gpus-per-node", "8"]
    assert f"train.init={HF_CONFIGS / recipe}" in argv
    assert [a for a in argv if a.startswith("model.")] == ["model.params_dtype=bfloat16"]
    args, cfg = load_train_config(argv)
    report = dry_run(cfg, world_size=resolve_world_size(None, args.nnodes, args.gpus_per_node)[0])
    figures = Figures(
        total_params(cfg.model),
        tuple(p.total for p in report.params),
        tuple(round(m.total) for m in report.memory),
    )
    assert figures == HAND_WRITTEN[recipe]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert f"dry run: {8 * nodes} GPUs" in out
    assert "verdict: fits" in out


def test_recipe_trains_from_the_converted_checkpoint_with_the_same_model(tmp_path):
    hf_dir = HF_CONFIGS / "qwen3_8b"
    _, dry = load_train_config(recorded_dry_run(tmp_path, "qwen3_8b"))
    megatron_dir = tmp_path / "Qwen3-8B-megatron"  # as the conversion leaves it
    megatron_dir.mkdir()
    (megatron_dir / "metadata.json").write_text("{}")
    (megatron_dir / MODEL_CONFIG_FILE).write_text(dump_config(dry.model))
    recording(tmp_path, "curl")  # every engine answers /health
    env = {"MEGATRON_DIR": str(megatron_dir), "OUTPUT_DIR": str(tmp_path / "out")}
    argv = run_script(tmp_path, "qwen3_8b", **env)
    train_argv = argv[argv.index("megatron_grpo.cli") + 1 :]
    assert f"train.init={megatron_dir}" in train_argv and f"tokenizer={hf_dir}" in train_argv
    _, cfg = load_train_config(train_argv)
    assert cfg.model == dry.model
    assert cfg.model.num_layers == 36 and cfg.model.params_dtype == "bfloat16"


def test_recipe_without_its_hf_directory_says_what_to_set(tmp_path):
    done = subprocess.run(
        ["bash", str(EXAMPLES / "run_grpo_qwen3_8b.sh"), "--dry-run"],
        env=clean_env(MODELS_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert f"{tmp_path}/Qwen3-8B/config.json not found: set HF_DIR" in done.stderr


def test_recipe_layout_follows_the_environment(tmp_path, capsys):
    argv = recorded_dry_run(tmp_path, "qwen3_8b", NNODES="2", GPUS_PER_NODE="4")
    assert argv[2:6] == ["--nnodes", "2", "--gpus-per-node", "4"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and "layout: DP=4 TP=2 PP=1 CP=1" in out


def test_broken_recipe_names_the_reason(tmp_path, capsys):
    # Qwen2.5-7B has 28 heads and 4 query groups: TP=8 divides neither.
    argv = recorded_dry_run(tmp_path, "qwen2.5_7b", "--set", "parallel.tp=8")
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert "model.num_attention_heads=28 is not divisible by TP=8" in err


def test_recipe_override_that_disagrees_with_config_json_is_refused(tmp_path, capsys):
    argv = recorded_dry_run(tmp_path, "qwen3_8b", "--set", "model.num_layers=32")
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert f"model section does not match {HF_CONFIGS / 'qwen3_8b'}/config.json" in err
    assert "model.num_layers=32 but num_hidden_layers=36" in err


def test_recipe_too_big_for_80gb_is_refused(tmp_path, capsys):
    argv = recorded_dry_run(tmp_path, "qwen2.5_72b", "--set", "parallel.pp=1")
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert "verdict: DOES NOT FIT" in out
    assert "the layout does not fit" in err and "80 GiB" in err
    assert "raise parallel.tp (now 8) or parallel.pp (now 1)" in err


def test_run_script_dry_run_end_to_end():
    ok = subprocess.run(
        ["bash", "examples/run_grpo_qwen3_8b.sh", "--dry-run"],
        cwd=ROOT,
        env=clean_env(HF_DIR=str(HF_CONFIGS / "qwen3_8b")),
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "layout: DP=4 TP=2 PP=1 CP=1" in ok.stdout and "verdict: fits" in ok.stdout
    assert "model: 8.191B parameters, 36 layers, vocabulary 151936" in ok.stdout
