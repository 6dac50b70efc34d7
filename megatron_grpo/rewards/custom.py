"""User reward functions named ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_function(spec: str, what: str = "custom reward") -> Callable[..., Any]:
    """The callable a ``package.module:function`` spec names; a ValueError names the spec
    (as ``what``: the option it came from)."""
    module_name, sep, attr = spec.partition(":")
    if not (module_name and sep and attr):
        raise ValueError(f"{what} {spec!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the module may fail in its own code, not only be missing
        raise ValueError(
            f"{what} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):  # "module:Class.method" works too
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj
