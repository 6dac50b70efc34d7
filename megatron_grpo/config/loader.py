"""Typed configs from YAML: nested keyword-only dataclasses, checked key by key.

``from_dict(cls, raw)`` builds dataclass ``cls`` from a nested dict. An
unknown key, a value of the wrong type, or an invalid value is a
``ValueError`` that names the key (``convert_fields`` checks and converts
without building). ``apply_override`` applies a dotted
``key=value`` (``optim.lr=1e-6``) to the nested dict first.

A key that moved (``MOVED_KEYS``) is still read under its old name: ``move_keys`` puts
the value in its new place with one ``MovedKeyWarning`` per key, and ``apply_override``
sets the new key for an override by the old name.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

MOVED_KEYS = {
    "train.hf_family": "model.hf_family",
    "optim.distributed_optimizer": "optim.use_distributed_optimizer",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.top_k": "rollout.sampling.top_k",
    "rollout.stop_token_ids": "rollout.sampling.stop_token_ids",
    "rollout.engine": "rollout.engines.type",
    "rollout.embedded_server": "rollout.engines.embedded_server",
    "rollout.urls": "rollout.engines.urls",
    "rollout.launch_command": "rollout.engines.launch_command",
    "rollout.num_servers": "rollout.engines.num_servers",
    "rollout.server_host": "rollout.engines.host",
    "rollout.server_startup_timeout_s": "rollout.engines.startup_timeout_s",
    "rollout.server_log_dir": "rollout.engines.log_dir",
    "rollout.router_url": "rollout.engines.router_url",
    "rollout.api_key_env": "rollout.engines.api_key_env",
    "rollout.max_concurrency": "rollout.client.max_concurrency",
    "rollout.request_timeout_s": "rollout.client.request_timeout_s",
    "rollout.connect_timeout_s": "rollout.client.connect_timeout_s",
    "rollout.control_timeout_s": "rollout.client.control_timeout_s",
    "rollout.weight_update_timeout_s": "rollout.client.weight_update_timeout_s",
    "rollout.sync_method": "rollout.sync.method",
    "rollout.sync_master_address": "rollout.sync.master_address",
    "rollout.sync_bucket_mb": "rollout.sync.bucket_mb",
    "rollout.sync_disk_dir": "rollout.sync.disk_dir",
    "rollout.check_weight_sync": "rollout.sync.check",
    "reward.format_pattern": "reward.format.pattern",
    "reward.format_mode": "reward.format.mode",
    "reward.format_match_score": "reward.format.match_score",
    "reward.format_miss_score": "reward.format.miss_score",
    "reward.format_weight": "reward.format.weight",
    "reward.remote_url": "reward.remote.url",
    "reward.remote_field": "reward.remote.field",
    "reward.remote_timeout": "reward.remote.timeout_s",
    "reward.remote_retries": "reward.remote.retries",
    "reward.remote_retry_backoff": "reward.remote.retry_backoff_s",
    "reward.remote_batch_size": "reward.remote.batch_size",
}
"""Keys that moved (old dotted name: new one). A config that gives the old name loads as if
it gave the new one, with a warning; one that gives both is refused."""


class MovedKeyWarning(FutureWarning):
    """A config names a key by its old name (``MOVED_KEYS``)."""


def new_key(key: str, *, warn: bool = True) -> str:
    """The name dotted ``key`` has now: itself, or, with a ``MovedKeyWarning``, the new name
    of a moved key."""
    moved = MOVED_KEYS.get(key)
    if moved is None:
        return key
    if warn:  # shown once per key and process, as Python shows a warning
        warnings.warn(f"config key '{key}' is now '{moved}'", MovedKeyWarning, stacklevel=1)
    return moved


def move_keys(raw: dict[str, Any], *, warn: bool = True) -> None:
    """Move every key of the nested dict ``raw`` that ``MOVED_KEYS`` names to its new place
    (in place), each with one ``MovedKeyWarning`` (``warn=False``: silently, for a config
    saved by an older version). A key given under both names is a ValueError naming both."""
    for old, new in MOVED_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        parent = _section(raw, old_parents)
        if parent is None or old_leaf not in parent:
            continue
        *new_parents, new_leaf = new.split(".")
        if new_leaf in (_section(raw, new_parents) or {}):
            raise ValueError(
                f"config gives both '{old}' and '{new}', the same key under its old and new "
                f"name: keep '{new}'"
            )
        _put(raw, new_key(old, warn=warn), parent.pop(old_leaf))


def _section(raw: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The nested dict at ``path``; None where it is absent or not a mapping."""
    node: Any = raw
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file (empty for an empty file)."""
    loaded = yaml.safe_load(Path(path).read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(f"{path}: the top level of a config must be a mapping")
    return loaded or {}


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; the value is parsed as YAML. A moved key
    sets its new name (``new_key``), as do the moved keys inside a mapping value."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"override {item!r} is not of the form key=value")
    set_dotted(raw, new_key(key.strip()), yaml.safe_load(value))


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` of a nested dict to ``value``, making the sections on the way; the
    moved keys inside a mapping ``value`` are moved (``move_keys``)."""
    _put(raw, key, value)
    if isinstance(value, dict):
        move_keys(raw)


def _put(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"config key {key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


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
        if key in MOVED_KEYS:  # in a dict handed to from_dict without move_keys
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
        raise ValueError("; or ".join(errors))
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
