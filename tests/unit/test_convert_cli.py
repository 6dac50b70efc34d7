"""``megatron-grpo convert`` and its ``tools/`` wrappers: one parser, refusals by name.

The conversions themselves run in tests/distributed/test_convert.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_grpo import cli

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).parents[2]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_missing_hf_dir_exits_2_naming_it(tmp_path):
    missing = tmp_path / "Qwen3-0.6B"
    result = run(
        *("-m", "megatron_grpo.cli", "convert", "hf-to-megatron"),
        *("--hf-dir", str(missing), "--out", str(tmp_path / "out")),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"megatron-grpo convert hf-to-megatron: error: argument --hf-dir: "
        f"no such directory: {missing}"
    )
    assert not (tmp_path / "out").exists()


def test_missing_megatron_dir_exits_2_in_the_tools_wrapper(tmp_path):
    missing = tmp_path / "ckpt"
    result = run(
        str(ROOT / "tools" / "convert_megatron_to_hf.py"),
        *("--megatron-dir", str(missing), "--out", str(tmp_path / "out")),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"convert_megatron_to_hf.py: error: argument --megatron-dir: no such directory: {missing}"
    )


def test_a_directory_without_config_json_is_refused_before_any_process(tmp_path, capsys):
    code = cli.main(
        ["convert", "hf-to-megatron", "--hf-dir", str(tmp_path), "--out", str(tmp_path / "out")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err == f"megatron-grpo convert hf-to-megatron: error: {tmp_path} has no config.json\n"
    assert not (tmp_path / "out").exists()


def test_a_direction_is_required():
    result = run("-m", "megatron_grpo.cli", "convert")
    assert result.returncode == 2
    assert "megatron-grpo convert: error: the following arguments are required: direction" in (
        result.stderr
    )


@pytest.mark.parametrize(
    ("direction", "tool"),
    [
        ("hf-to-megatron", "convert_hf_to_megatron.py"),
        ("megatron-to-hf", "convert_megatron_to_hf.py"),
    ],
)
def test_tools_wrapper_has_the_subcommands_options_and_help(direction, tool):
    def after_usage(text: str) -> str:
        """The help without its usage lines, which name the program."""
        return text.split("\n\n", 1)[1]

    subcommand = run("-m", "megatron_grpo.cli", "convert", direction, "--help")
    wrapper = run(str(ROOT / "tools" / tool), "--help")
    assert subcommand.returncode == wrapper.returncode == 0
    assert after_usage(wrapper.stdout) == after_usage(subcommand.stdout)
    assert "--out OUT" in subcommand.stdout and "--timeout TIMEOUT" in subcommand.stdout


# ----------------------------------------------------------------- what --megatron-dir names


def fake_run(root: Path, *, tokenizer: Path | None, init: Path | None, steps=(2, 4)) -> Path:
    """A run directory as training leaves it: its config and checkpoints (no weights)."""
    from megatron_grpo.config import Config, TrainConfig, dump_config

    run = root / "run"
    cfg = Config(
        output_dir=str(run),
        tokenizer=None if tokenizer is None else str(tokenizer),
        train=TrainConfig(init=None if init is None else str(init)),
    )
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    for step in steps:
        (run / "checkpoints" / f"step_{step:08d}").mkdir()
        (run / "checkpoints" / f"step_{step:08d}" / "metadata.json").write_text("{}")
    if steps:
        (run / "checkpoints" / "latest").write_text(f"step_{steps[-1]:08d}")
    return run


def hf_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_run_and_its_checkpoints_name_their_model_template_and_tokenizer(tmp_path):
    from megatron_grpo.commands.convert.export_source import resolve_source

    init = hf_dir(tmp_path / "init")
    run = fake_run(tmp_path, tokenizer=None, init=init)
    latest = resolve_source(run)
    assert latest.checkpoint == run / "checkpoints" / "step_00000004"
    assert (latest.template, latest.tokenizer) == (init, init)  # train.init's files
    assert latest.model.num_layers == 2  # the run config's model section
    older = resolve_source(run / "checkpoints" / "step_00000002")
    assert older.checkpoint == run / "checkpoints" / "step_00000002"
    assert (older.model, older.template, older.tokenizer) == (
        latest.model,
        latest.template,
        latest.tokenizer,
    )
    tokenizer = hf_dir(tmp_path / "tokenizer")
    given = resolve_source(run, tokenizer_dir=tokenizer, hf_config_dir=tokenizer)
    assert (given.template, given.tokenizer) == (tokenizer, tokenizer)


def convert_error(megatron_dir: Path, capsys) -> str:
    code = cli.main(
        ["convert", "megatron-to-hf", "--megatron-dir", str(megatron_dir), "--out", "unused"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-grpo convert megatron-to-hf: error: ") and err.count("\n") == 1
    return err


def test_a_directory_of_no_kind_says_what_each_kind_looks_like(tmp_path, capsys):
    err = convert_error(tmp_path, capsys)
    assert f"{tmp_path} holds no megatron checkpoint: give a training run (<run>/config.yaml" in err
    assert "<run>/checkpoints/step_<N>" in err and "metadata.json and model.yaml" in err
    run = fake_run(tmp_path, tokenizer=None, init=hf_dir(tmp_path / "init"))
    err = convert_error(run / "checkpoints", capsys)
    assert f"(it is a run's checkpoints folder: give the run, {run})" in err
    err = convert_error(tmp_path / "init", capsys)
    assert "(it is a Hugging Face model directory already)" in err
    assert not Path("unused").exists()


def test_a_run_without_a_checkpoint_says_when_training_saves_one(tmp_path, capsys):
    run = fake_run(tmp_path, tokenizer=None, init=hf_dir(tmp_path / "init"), steps=())
    err = convert_error(run, capsys)
    assert f"{run} is a training run with no checkpoint yet" in err
    assert "every train.save_interval steps and at its last" in err


def test_a_checkpoint_outside_a_run_without_model_yaml_asks_for_the_model_config(tmp_path, capsys):
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "metadata.json").write_text("{}")
    err = convert_error(tmp_path / "step_00000004", capsys)
    assert "is a megatron checkpoint without model.yaml and not inside a run" in err
    assert "give --model-config (the run's config.yaml, or a model.yaml)" in err


def test_a_runs_tokenizer_not_found_from_here_names_the_option(tmp_path, capsys):
    run = fake_run(tmp_path, tokenizer=Path("elsewhere/tokenizer"), init=None)
    err = convert_error(run, capsys)
    assert "the run's tokenizer 'elsewhere/tokenizer'" in err
    assert "is not a directory here (relative to the current one): give --tokenizer-dir" in err
    run = fake_run(tmp_path / "b", tokenizer=None, init=None)
    assert "names no tokenizer" in convert_error(run, capsys)
