"""Typed configs from YAML: nested keyword-only dataclasses, checked key by key.

``from_dict(cls, raw)`` builds dataclass ``cls`` from a nested dict. An
unknown key, a value of the wrong type, or an invalid value is a
``ValueError`` that names the key (``convert_fields`` checks and converts
without building). ``apply_override`` applies a dotted
``key=value`` (``optim.lr=1e-6``) to the nested dict first.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

MOVED_KEYS = {"train.hf_family": "model.hf_family"}
"""Keys that moved to another section: named in the error instead of 'unknown'."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file (empty for an empty file)."""
    loaded = yaml.safe_load(Path(path).read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(f"{path}: the top level of a config must be a mapping")
    return loaded or {}


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} is not of the form key=value")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = yaml.safe_load(value)


def from_dict(cls: type, raw: Any, *, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, checking keys and value types."""
    kwargs = convert_fields(cls, raw, prefix=prefix)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def convert_fields(cls: type, raw: Any, *, prefix: str = "") -> dict[str, Any]:
    """The values of ``raw`` as the types of dataclass ``cls``'s fields, without building it."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        if key in MOVED_KEYS:
            raise ValueError(f"config key '{key}' is now '{MOVED_KEYS[key]}'")
        raise ValueError(
            f"unknown config key '{key}' (known keys in {where}: {', '.join(sorted(fields))})"
        )
    return {name: _convert(hints[name], value, f"{prefix}{name}") for name, value in raw.items()}


def _convert(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=key + ".")  # type: ignore[arg-type]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} must be a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return origin(_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        return _float(value, key)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {tp.__name__}, got {value!r}")
    return value


def _float(value: Any, key: str) -> float:
    number = value
    if isinstance(value, int) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)  # YAML reads 1e-6 as a string
        except ValueError:
            pass
    if not isinstance(number, float):
        raise ValueError(f"{key} must be float, got {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return number


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any) -> str:
    """The resolved config as YAML, for printing at start and saving beside checkpoints."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
