"""A deterministic reward's values, kept by (response, label, metadata).

GRPO scores every sample of a group against the same label, and short answers
repeat within a group and across steps; a pure reward function then gives the
same value again. ``RewardMemo`` calls it once per distinct job and keeps the
values of the most recently used ones. An exception is never kept: the job is
tried again in the next batch.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from megatron_grpo.rewards.math_answer import MathReward
from megatron_grpo.rewards.text import FormatReward, exact_match

Job = tuple[str, Any, Any]
"""``(response, label, metadata)``."""


def is_deterministic(fn: Callable[..., Any]) -> bool:
    """The built-in rule rewards, and any function whose ``deterministic`` attribute is True."""
    if isinstance(fn, MathReward | FormatReward):
        return True
    if isinstance(fn, functools.partial) and fn.func is exact_match:
        return True
    return getattr(fn, "deterministic", False) is True


class RewardMemo:
    """The last ``size`` distinct jobs' values (least recently used dropped first)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a reward memo needs room for at least one value, got {size}")
        self.size = size
        self._values: OrderedDict[tuple[str, str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def run(
        self, jobs: Sequence[Job], compute: Callable[[list[Job]], list[object]]
    ) -> list[object]:
        """Each job's value: kept ones as they are, the others from one ``compute`` call on
        the distinct ones (each a value or the exception it raised). Safe to call from
        several threads (the values are looked up and stored under a lock; ``compute``
        runs outside it)."""
        keys = [(response, repr(label), repr(meta)) for response, label, meta in jobs]
        kept: dict[tuple[str, str, str], object] = {}
        todo: dict[tuple[str, str, str], Job] = {}
        with self._lock:
            for key, job in zip(keys, jobs, strict=True):
                if key in self._values:
                    self._values.move_to_end(key)
                    kept[key] = self._values[key]
                else:
                    todo.setdefault(key, job)
        computed = dict(zip(todo, compute(list(todo.values())), strict=True))
        with self._lock:
            for key, value in computed.items():
                if not isinstance(value, Exception):
                    self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return [computed[key] if key in computed else kept[key] for key in keys]
