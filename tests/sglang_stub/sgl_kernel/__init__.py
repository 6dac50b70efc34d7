"""Import-only stand-in for SGLang's CPU/GPU kernel package ``sgl_kernel``.

``sglang-kernel`` is not installable on a CPU-only machine without a GPU
toolchain, yet ``sglang`` imports names from it at module level. With this
directory on ``PYTHONPATH`` those imports succeed; calling any of the names
raises NotImplementedError, so a code path that really needs a kernel fails
loudly instead of computing something wrong. The CPU path used by the tests
(``--device cpu --attention-backend torch_native``) calls none of them.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+stub"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} is not available (import-only stand-in)")

    _missing.__name__ = name
    return _missing
