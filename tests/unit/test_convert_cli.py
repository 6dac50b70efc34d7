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
