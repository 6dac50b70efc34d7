"""What ``convert megatron-to-hf --megatron-dir`` names, and where the rest comes from.

Three kinds of directory:
- a training run (``<run>/config.yaml`` and ``<run>/checkpoints/``): its latest checkpoint;
- a training checkpoint (``<run>/checkpoints/step_<N>``);
- a checkpoint made by ``convert hf-to-megatron`` (``metadata.json`` and ``model.yaml``,
  with the source's config and tokenizer files in ``hf/``).

A run's saved config (``run_start.saved_config_path``: the one its checkpoints were last
trained with) gives the model section, and the run's ``train.init`` and ``tokenizer`` the
config template and the tokenizer (``save_hf.run_hf_files``, as the trainer's own
Hugging Face saves use them). ``--model-config``, ``--hf-config-dir`` and
``--tokenizer-dir`` override each. Everything is checked here, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_grpo.commands.convert.hf_to_megatron import load_model_config
from megatron_grpo.config import Config, ModelConfig, from_dict
from megatron_grpo.config.init_model import MODEL_CONFIG_FILE
from megatron_grpo.config.loader import move_keys, read_yaml
from megatron_grpo.convert.hf_files import HF_FILES_DIR, check_tokenizer_dir
from megatron_grpo.train.run_start import saved_config_path
from megatron_grpo.train.save_hf import run_hf_files
from megatron_grpo.train.state import checkpoints_dir, latest_checkpoint

KINDS = (
    "a training run (<run>/config.yaml and <run>/checkpoints/), one of its checkpoints "
    "(<run>/checkpoints/step_<N>, with metadata.json), or a checkpoint made by "
    f"convert hf-to-megatron (metadata.json and {MODEL_CONFIG_FILE})"
)


@dataclass(frozen=True)
class ExportSource:
    checkpoint: Path
    """The distributed checkpoint to read."""
    model: ModelConfig
    template: Path | None
    """Whose ``config.json`` (and ``generation_config.json``) is written back."""
    tokenizer: Path | None


def _is_checkpoint(path: Path) -> bool:
    return (path / "metadata.json").is_file()


def _is_run(path: Path) -> bool:
    return saved_config_path(path) is not None and not _is_checkpoint(path)


def _run_of_checkpoint(path: Path) -> Path | None:
    """The run that saved checkpoint ``path`` (``<run>/checkpoints/step_<N>``), if any."""
    parent = path.resolve().parent
    run = parent.parent
    return run if parent == checkpoints_dir(run) and _is_run(run) else None


def _run_checkpoint(run: Path) -> Path:
    latest = latest_checkpoint(run)
    if latest is None:
        raise ValueError(
            f"{run} is a training run with no checkpoint yet ({checkpoints_dir(run)}/latest "
            "names none): training saves one every train.save_interval steps and at its last"
        )
    return latest


def _load_run_config(run: Path) -> Config:
    path = saved_config_path(run)
    assert path is not None
    try:
        raw = read_yaml(path)
        move_keys(raw, warn=False)  # saved by a version from before some keys moved
        return from_dict(Config, raw)  # as saved: resolved, nothing to fill in
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _named_dir(path: Path, what: str, run: Path, option: str) -> Path:
    """``path``, a directory the run's config names; a ValueError naming the fix if it is
    not one from here."""
    if not path.is_dir():
        raise ValueError(
            f"the run's {what} {str(path)!r} (from {saved_config_path(run)}) is not a "
            f"directory here{'' if path.is_absolute() else ' (relative to the current one)'}: "
            f"give {option}, or convert from where the run was started"
        )
    return path


def resolve_source(
    megatron_dir: str | Path,
    *,
    model_config: str | Path | None = None,
    hf_config_dir: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
) -> ExportSource:
    """The checkpoint, model config, config template and tokenizer of an export of
    ``megatron_dir`` (see the module's docstring); a ValueError says what is wrong and
    what to give instead."""
    path = Path(megatron_dir)
    run = path if _is_run(path) else _run_of_checkpoint(path)
    if run is None and not _is_checkpoint(path):
        raise ValueError(f"{path} holds no megatron checkpoint{_what_it_is(path)}: give {KINDS}")
    checkpoint = _run_checkpoint(path) if run == path else path
    model: ModelConfig | None = None
    template: Path | None
    tokenizer: Path | None
    if run is not None:
        run_cfg = _load_run_config(run)
        model = run_cfg.model
        template, tokenizer = run_hf_files(run_cfg)
        if template is not None and hf_config_dir is None:
            _named_dir(template, "train.init", run, "--hf-config-dir")
        if tokenizer_dir is None:
            tokenizer = _run_tokenizer(run, tokenizer)
    else:
        sidecar = path / HF_FILES_DIR
        template = sidecar if (sidecar / "config.json").is_file() else None
        tokenizer = sidecar if sidecar.is_dir() else None
    if model_config is not None:
        model = load_model_config(model_config)
    elif model is None:
        if not (path / MODEL_CONFIG_FILE).is_file():
            raise ValueError(
                f"{path} is a megatron checkpoint without {MODEL_CONFIG_FILE} and not inside a "
                "run (no <run>/config.yaml above <run>/checkpoints/): give --model-config (the "
                "run's config.yaml, or a model.yaml)"
            )
        model = load_model_config(path / MODEL_CONFIG_FILE)
    if hf_config_dir is not None:
        template = Path(hf_config_dir)
    if tokenizer_dir is not None:
        tokenizer = Path(tokenizer_dir)
        check_tokenizer_dir(tokenizer)
    return ExportSource(checkpoint, model, template, tokenizer)


def _what_it_is(path: Path) -> str:
    """What ``path`` looks like instead, when that is plain."""
    if (path / "latest").is_file():
        return f" (it is a run's checkpoints folder: give the run, {path.parent})"
    if path.name.endswith(".partial"):
        return " (it is a save that did not finish)"
    if (path / "config.json").is_file():
        return " (it is a Hugging Face model directory already)"
    return ""


def _run_tokenizer(run: Path, tokenizer: Path | None) -> Path:
    if tokenizer is None:
        raise ValueError(
            f"the run {run} names no tokenizer (tokenizer, or train.init as a Hugging Face "
            "directory): give --tokenizer-dir"
        )
    check_tokenizer_dir(_named_dir(tokenizer, "tokenizer", run, "--tokenizer-dir"))
    return tokenizer
