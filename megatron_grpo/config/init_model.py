"""The model section of a run that starts from a checkpoint (``train.init``).

A Hugging Face directory (``config.json``) or a megatron checkpoint made by the
conversion command (``MODEL_CONFIG_FILE`` beside its ``metadata.json``) says
which model it holds. When the config is loaded, its architecture fields
(``HF_NAMES``) fill the ``model`` section; the training-only fields
(``params_dtype``, ``init_method_std``, ``make_vocab_size_divisible_by``) stay
the config's. A model field the config gives as well must agree with the
checkpoint: those that do not are refused together, in one error.

A ``train.init`` that is neither leaves the model section alone (a config can be
read where its checkpoint is not); ``megatron-grpo train`` refuses it before any
process starts, saying what was looked for and where (``init_kind``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from megatron_grpo.config.hf import HF_NAMES, head_dim, model_config_from_hf, read_hf_config
from megatron_grpo.config.loader import convert_fields, from_dict, read_yaml
from megatron_grpo.config.model import ModelConfig

MODEL_CONFIG_FILE = "model.yaml"
"""The resolved ``ModelConfig`` that a converted megatron checkpoint keeps beside its weights."""


InitKind = Literal["hf", "megatron"]


def _kind(path: str | Path) -> InitKind | None:
    p = Path(path)
    if (p / "metadata.json").exists():
        return "megatron"
    if (p / "config.json").exists():
        return "hf"
    return None


INIT_KINDS = (
    "a Hugging Face model directory (with config.json) or a megatron checkpoint directory "
    "(with metadata.json)"
)
"""What ``train.init`` may name."""


def describe_path(path: str) -> str:
    """``path`` as given, and where it was looked for when that is not what it says: a
    relative path is resolved against the current directory, and ``~`` is not expanded."""
    if path.startswith("~"):
        return f"{path!r} (~ is not expanded in a config: write {os.path.expanduser(path)})"
    if not os.path.isabs(path):
        return f"{path!r} (looked for {os.path.abspath(path)}, from the current directory)"
    return repr(path)


def init_kind(path: str) -> InitKind:
    """``megatron`` (a distributed checkpoint) or ``hf`` (a Hugging Face model directory);
    a FileNotFoundError says what was looked for and where."""
    kind = _kind(path)
    if kind is not None:
        return kind
    where = f"train.init={describe_path(path)}"
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where} does not exist: give {INIT_KINDS}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where} is a file: give {INIT_KINDS}")
    raise FileNotFoundError(
        f"{where} is neither a megatron checkpoint (no metadata.json in it) "
        "nor a Hugging Face model directory (no config.json in it)"
    )


def checkpoint_model(path: str | Path) -> tuple[Path, ModelConfig, Mapping[str, str]] | None:
    """(the file read, the model it describes, what that file calls each field) of a checkpoint.

    None when ``path`` does not say which model it holds: neither kind, or a
    megatron checkpoint without ``MODEL_CONFIG_FILE`` (one saved by training).
    """
    kind = _kind(path)
    source = Path(path, MODEL_CONFIG_FILE if kind == "megatron" else "config.json")
    if kind is None or not source.is_file():
        return None
    try:
        if kind == "hf":
            return source, model_config_from_hf(read_hf_config(path)), HF_NAMES
        model = from_dict(ModelConfig, read_yaml(source), prefix="model.")
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    model.head_dim = head_dim(model)  # None in the file means the same as this
    return source, model, {name: name for name in HF_NAMES}


def _given(name: str, value: Any, model: Mapping[str, Any]) -> Any:
    """A given field's value, with None (derived) resolved as ``ModelConfig`` resolves it."""
    if value is None and name == "num_query_groups":
        return model["num_attention_heads"]
    if value is None and name == "head_dim":
        return model["hidden_size"] // model["num_attention_heads"]
    return value


def fill_model_section(raw: dict[str, Any]) -> None:
    """Fill ``raw["model"]`` from ``raw["train"]["init"]`` when that checkpoint names its model.

    Raises a ValueError naming every model field the config gives that
    disagrees with the checkpoint.
    """
    train, given = raw.get("train"), raw.get("model", {})
    init = train.get("init") if isinstance(train, dict) else None
    if not isinstance(init, str) or not isinstance(given, dict):
        return  # no checkpoint, or a malformed section that building the config names
    found = checkpoint_model(init)
    if found is None:
        return
    source, model, names = found
    resolved = {name: getattr(model, name) for name in HF_NAMES}
    wrong = [
        f"model.{name}={value!r} but {names[name]}={resolved[name]!r}"
        for name, value in convert_fields(ModelConfig, given, prefix="model.").items()
        if name in resolved and _given(name, value, resolved) != resolved[name]
    ]
    if wrong:
        raise ValueError(f"model section does not match {source}: " + "; ".join(wrong))
    raw["model"] = given | resolved
