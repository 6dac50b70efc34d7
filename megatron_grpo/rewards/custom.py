"""User reward functions: named ``package.module:function``, pickled in a file, or handed over
as objects in this process.

A function object reaches the scorer one of three ways (``megatron_grpo.api`` picks):
- by name, when ``importable_spec`` finds one that imports back to the same object: a
  worker process imports it as the config names it;
- pickled by value in a file (``reward.custom_pickle``), for an object that has no such name
  but pickles without referring to ``__main__`` (e.g. a ``functools.partial`` or an instance
  of an importable class): ``pickled`` writes it, ``load_pickled`` reads it back;
- held in this process (``held``): ``reward.custom_function`` names it under
  ``IN_PROCESS``, which no other process can resolve; any callable, lambdas included.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import pickletools
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

IN_PROCESS = "megatron_grpo.rewards.custom:in_process."
"""The spec prefix of a function object held in this process (``held``)."""

in_process = types.SimpleNamespace()
"""The function objects held in this process, by name (``load_function`` reads them as it
reads any module attribute)."""

MAIN_MODULES = ("__main__", "__mp_main__")


def load_function(spec: str, what: str = "custom reward") -> Callable[..., Any]:
    """The callable a ``package.module:function`` spec names; a ValueError names the spec
    (as ``what``: the option it came from)."""
    module_name, sep, attr = spec.partition(":")
    if not (module_name and sep and attr):
        raise ValueError(f"{what} {spec!r} is not of the form 'package.module:function'")
    if spec.startswith(IN_PROCESS) and not hasattr(in_process, spec[len(IN_PROCESS) :]):
        raise ValueError(
            f"{what} {spec!r} is a function object that megatron_grpo.train() held in the "
            "process that called it, not in this one: name an importable function instead "
            "(package.module:function), or call megatron_grpo.train() again with it"
        )
    try:
        importlib.import_module(module_name)
    except Exception as e:  # the module may fail in its own code, not only be missing
        raise ValueError(
            f"{what} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    try:
        obj = pkgutil.resolve_name(spec)  # "module:Class.method" works too
    except AttributeError:
        raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


@contextlib.contextmanager
def held(fn: Callable[..., Any]) -> Iterator[str]:
    """Hold ``fn`` in this process while the block runs; its spec, which names it by its
    ``__name__`` (so that a resumed run's config names it as the first run's did)."""
    base = re.sub(r"\W", "_", getattr(fn, "__name__", None) or type(fn).__name__).strip("_")
    name = base = base or "function"
    number = 1
    while hasattr(in_process, name):  # one of that name is held already (a train in a train)
        number += 1
        name = f"{base}_{number}"
    setattr(in_process, name, fn)
    try:
        yield IN_PROCESS + name
    finally:
        delattr(in_process, name)


def importable_spec(fn: Callable[..., Any]) -> str | None:
    """A ``module:name`` that imports back to ``fn`` itself (a module-level function or
    class, or a module attribute bound to it), outside ``__main__``; None when there is none."""
    module_name = getattr(fn, "__module__", None)
    if not isinstance(module_name, str) or module_name in MAIN_MODULES:
        return None
    module = sys.modules.get(module_name)
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(qualname, str) and "<" not in qualname:
        with contextlib.suppress(ValueError):
            if load_function(f"{module_name}:{qualname}") is fn:
                return f"{module_name}:{qualname}"
    for name, value in vars(module).items() if module is not None else ():
        if value is fn and not name.startswith("_"):
            return f"{module_name}:{name}"
    return None


def pickled(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled for another process; a ValueError says why it cannot be: pickle sends
    functions and classes by name, and another process cannot import ``__main__``'s names,
    a lambda's or a nested function's."""
    qualname = getattr(fn, "__qualname__", "") or ""
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError("it is a lambda or a nested function, which pickle cannot send")
    try:
        data = pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"pickle cannot send it: {type(e).__name__}: {e}") from None
    if refers_to_main(data):
        raise ValueError(
            "it is defined in __main__ (a notebook, or the script being run), whose names "
            "other processes cannot import"
        )
    return data


def refers_to_main(data: bytes) -> bool:
    """A pickle that names something in ``__main__`` (as a module name or a global)."""
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST") and str(arg).split(" ")[0] in MAIN_MODULES:
            return True
        if "UNICODE" in op.name and arg in MAIN_MODULES:
            return True
    return False


def load_pickled(path: str) -> Callable[..., Any]:
    """The function pickled in ``path`` (``reward.custom_pickle``); a ValueError says what
    is wrong with it."""
    what = f"reward.custom_pickle {path!r}"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} cannot be read: {e}") from None
    try:
        fn = pickle.loads(data)
    except Exception as e:  # a module it names may be missing here
        raise ValueError(f"{what} does not unpickle here: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{what} holds a {type(fn).__name__}, not a callable")
    return fn
