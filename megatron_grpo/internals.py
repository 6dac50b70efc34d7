"""Third-party internals the package patches or leans on: declared, and checked at start-up.

A patch of a library's internals breaks silently when the library moves them: assigning a
renamed function creates a new attribute nobody reads, a wrapper calls a function with a
keyword it no longer takes, and the run fails far from the cause, or hangs. So each
library's compat module (docs/architecture.md, "Third-party internals") declares every
attribute it replaces, wraps, calls or sets as a ``Target``, with the release it was
tested on (``Library``). ``check`` runs where the patches are installed: on the tested
release it does nothing; on any other it looks every target up and raises
``MovedInternals`` naming what moved (module, attribute, missing parameter), or warns
that the release is untested when nothing did.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    """One third-party attribute a patch touches."""

    module: str
    """The module that holds it, e.g. ``megatron.core.tensor_parallel.random``."""
    attr: str
    """Its dotted path inside the module, e.g. ``CheckpointFunction.backward``."""
    why: str
    """What the patch does with it, and why."""
    params: tuple[str, ...] = ()
    """The parameters of its signature that the patch calls it with or is called with."""
    kind: Literal["attribute", "instance", "global"] = "attribute"
    """``attribute``: ``module.attr`` exists. ``instance``: ``attr`` is ``Class.name``, an
    attribute only instances have, which a method of the class (or of a base) sets on
    ``self``. ``global``: a function of the module reads the global name ``attr``, which may
    be absent (the patch defines it then)."""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class Library:
    """A third-party library, the release the package was tested with, and its targets."""

    distribution: str
    """Its name on the package index, as ``importlib.metadata`` knows it."""
    tested: str
    compat_module: str
    """Where its patches live (named in the error)."""
    targets: tuple[Target, ...]


class MovedInternals(RuntimeError):
    """An installed library no longer has internals that the package patches."""


class UntestedRelease(UserWarning):
    """An installed library is not the tested release, though every target is still there."""


def release(version: str) -> str:
    """``2.13.0`` of ``2.13.0+cpu``: the local build label does not change the code."""
    return version.split("+")[0]


def installed_version(library: Library) -> str:
    return importlib.metadata.version(library.distribution)


def check(library: Library, installed: str | None = None) -> list[str]:
    """Compare the installed release of ``library`` with the tested one; on another release,
    look every target up. Raises ``MovedInternals`` if one is missing, else warns
    ``UntestedRelease``. Returns the problems found (none on the tested release)."""
    installed = installed or installed_version(library)
    if release(installed) == release(library.tested):
        return []
    problems = moved(library)
    head = (
        f"{library.distribution} {installed} is installed; megatron_grpo was tested with "
        f"{library.tested}"
    )
    if problems:
        raise MovedInternals(
            f"{head}; of the {len(library.targets)} internals of it that megatron_grpo patches "
            f"or calls, {len(problems)} moved:\n  - " + "\n  - ".join(problems) + f"\nInstall "
            f"{library.distribution}=={library.tested}, or port {library.compat_module}."
        )
    warnings.warn(
        f"{head}; all {len(library.targets)} internals of it that megatron_grpo patches or "
        f"calls are still there ({library.compat_module}), but this release is untested.",
        UntestedRelease,
        stacklevel=2,
    )
    return []


def moved(library: Library) -> list[str]:
    """Each target of ``library`` that the installed release lacks: what moved, and why the
    package needs it."""
    return [f"{t.name}: {p}\n      ({t.why})" for t in library.targets if (p := problem(t))]


def problem(target: Target) -> str | None:
    """What is wrong with ``target`` in the installed library, or None."""
    try:
        module = importlib.import_module(target.module)
    except ImportError as err:
        return f"module {target.module} cannot be imported ({err})"
    if target.kind == "global":
        if not any(target.attr in _names(code, "LOAD_GLOBAL") for code in _module_code(module)):
            return f"no function of {target.module} reads the global {target.attr!r} any more"
        return None
    *owner_path, last = target.attr.split(".")
    owner: Any = module
    walked = [target.module]
    for part in owner_path:
        if not hasattr(owner, part):
            return f"{'.'.join(walked)} has no attribute {part!r}"
        owner = getattr(owner, part)
        walked.append(part)
    if target.kind == "instance":
        if not any(last in _names(code, "STORE_ATTR") for code in _class_code(owner)):
            return f"no method of {owner.__qualname__} sets self.{last} any more"
        return None
    if not hasattr(owner, last):
        return f"{'.'.join(walked)} has no attribute {last!r}"
    if not target.params:
        return None
    try:
        signature = inspect.signature(getattr(owner, last))
    except (TypeError, ValueError):
        return f"the signature of {target.attr} cannot be read"
    missing = [p for p in target.params if p not in signature.parameters]
    if missing:
        return f"parameter {', '.join(map(repr, missing))} missing from {target.attr}{signature}"
    return None


def _names(code: types.CodeType, opname: str) -> set[str]:
    """The names ``code`` (and the functions and classes inside it) use with ``opname``."""
    import dis

    found = {i.argval for i in dis.get_instructions(code) if i.opname == opname}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const, opname)
    return found


def _functions(namespace: Mapping[str, Any]) -> Iterator[Callable]:
    for value in namespace.values():
        value = getattr(value, "__func__", value)  # staticmethod, classmethod
        if isinstance(value, types.FunctionType):
            yield inspect.unwrap(value)


def _class_code(cls: type) -> Iterator[types.CodeType]:
    for klass in inspect.getmro(cls):
        for fn in _functions(vars(klass)):
            yield fn.__code__


def _module_code(module: types.ModuleType) -> Iterator[types.CodeType]:
    for fn in _functions(vars(module)):
        yield fn.__code__
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            for fn in _functions(vars(value)):
                yield fn.__code__
