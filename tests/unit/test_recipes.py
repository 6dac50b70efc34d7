"""The recipes: model files hold only MODEL_ARGS, and every run script's dry run passes.

Each run script is run with ``--dry-run`` by bash, with a stand-in ``megatron-grpo`` on PATH
that records its arguments; the recorded command is then run in this process (one torch
import for all recipes). One recipe also runs end to end through the real command.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_grpo import cli
from megatron_grpo.config import load_config
from megatron_grpo.convert.hf_config import check_family, get_family

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS = {
    "qwen3_0.6b": "qwen3",
    "qwen3_1.7b": "qwen3",
    "qwen3_4b": "qwen3",
    "qwen3_8b": "qwen3",
    "qwen3_14b": "qwen3",
    "qwen3_32b": "qwen3",
    "qwen2.5_7b": "qwen2",
    "qwen2.5_32b": "qwen2",
    "qwen2.5_72b": "qwen2",
    "llama3.1_8b": "llama",
    "llama3.1_70b": "llama",
}
LAYOUT_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAYOUT_VARS}
    return {**env, **extra}


def recorded_dry_run(tmp_path: Path, recipe: str, *args: str, **env: str) -> list[str]:
    """The megatron-grpo arguments ``run_grpo_<recipe>.sh --dry-run`` passes."""
    shim = tmp_path / "megatron-grpo"
    shim.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGS_OUT"\n')
    shim.chmod(0o755)
    out = tmp_path / "args"
    subprocess.run(
        ["bash", str(EXAMPLES / f"run_grpo_{recipe}.sh"), "--dry-run", *args],
        env=clean_env(PATH=f"{tmp_path}:{os.environ['PATH']}", ARGS_OUT=str(out), **env),
        check=True,
    )
    return out.read_text().split("\0")[:-1]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the scripts pass paths relative to the repository root
    try:
        code = cli.main(argv)
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_model_has_a_model_file_and_a_run_script():
    assert sorted(p.stem for p in (EXAMPLES / "models").glob("*.sh")) == sorted(MODELS)
    scripts = sorted(p.stem.removeprefix("run_grpo_") for p in EXAMPLES.glob("run_grpo_*.sh"))
    assert scripts == sorted([*MODELS, "cpu_tiny"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_file_holds_only_model_args(name):
    lines = (EXAMPLES / "models" / f"{name}.sh").read_text().splitlines()
    body = [line for line in lines if line.strip() and not line.startswith("#")]
    assert body[0] == "MODEL_ARGS=(" and body[-1] == ")"
    assert all(re.fullmatch(r"  --set (model|train)\.\w+=\S+", line) for line in body[1:-1])
    overrides = [line.split()[1] for line in body[1:-1]]
    cfg = load_config(None, overrides)
    assert cfg.model.hf_family == MODELS[name]
    check_family(cfg.model, get_family(MODELS[name]))
    assert cfg.model.params_dtype == "bfloat16"
    assert any(line.startswith("# Qwen") or line.startswith("# Llama") for line in lines)
    assert "config.json" in "\n".join(lines)  # where the numbers come from


@pytest.mark.parametrize("recipe", sorted(MODELS))
def test_recipe_dry_run_fits_at_its_world_size(recipe, tmp_path, capsys):
    script = (EXAMPLES / f"run_grpo_{recipe}.sh").read_text()
    nodes = int(re.search(r"TRAIN_NODES=(\d+)", script).group(1))
    argv = recorded_dry_run(tmp_path, recipe)
    assert argv[:6] == ["train", "--dry-run", "--nnodes", str(nodes), "--gpus-per-node", "8"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert f"dry run: {8 * nodes} GPUs" in out
    assert "verdict: fits" in out


def test_recipe_layout_follows_the_environment(tmp_path, capsys):
    argv = recorded_dry_run(tmp_path, "qwen3_8b", NNODES="2", GPUS_PER_NODE="4")
    assert argv[2:6] == ["--nnodes", "2", "--gpus-per-node", "4"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and "layout: DP=2 TP=4 PP=1 CP=1" in out


def test_broken_recipe_names_the_reason(tmp_path, capsys):
    # Qwen2.5-7B has 28 heads and 4 query groups: TP=8 divides neither.
    argv = recorded_dry_run(tmp_path, "qwen2.5_7b", "--set", "parallel.tp=8")
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert "model.num_attention_heads=28 is not divisible by TP=8" in err


def test_recipe_too_big_for_80gb_is_refused(tmp_path, capsys):
    argv = recorded_dry_run(tmp_path, "qwen3_32b", "--set", "parallel.pp=1")
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert "verdict: DOES NOT FIT" in out
    assert "the layout does not fit" in err and "80 GiB" in err
    assert "raise parallel.tp (now 8) or parallel.pp (now 1)" in err


def test_run_script_dry_run_end_to_end():
    ok = subprocess.run(
        ["bash", "examples/run_grpo_qwen3_8b.sh", "--dry-run"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "layout: DP=2 TP=4 PP=1 CP=1" in ok.stdout and "verdict: fits" in ok.stdout
