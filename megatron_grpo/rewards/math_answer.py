"""Math answer verification with the math-verify library.

The final answer is the last balanced ``\\boxed{...}`` of the response; without
one, math-verify finds it in the text ("the answer is ...", else the last LaTeX
or plain expression). The label is parsed the same way, inside ``$...$`` when it
has neither a box nor a dollar sign. math-verify compares the two as sympy
objects: numbers (rounded to 6 decimals), fractions, LaTeX, intervals, sets,
matrices, ``x = 5`` against ``5``, thousands separators, with units, ``\\text{}``
and degree signs dropped. An answer it cannot read as maths (a word, a choice
letter) still scores when its text, without markup or spaces, equals the label's.

math-verify gives up parsing, and each comparison, after ``timeout_s`` whole
seconds, and the answer then counts as wrong. Its limit is ``signal.alarm``,
which works only in a process's main thread: the trainer's scorer, or a reward
worker process (``reward.num_workers``), never a thread of its own.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (nested braces included)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : i]
        # Unbalanced (a truncated response): an earlier box may still be whole.
    return None


def normalize_text(text: str) -> str:
    """An answer as text: ``\\text{..}`` unwrapped, no whitespace, no final period."""
    text = _TEXT_CMD.sub(r"\1", text)
    return "".join(text.split()).rstrip(".")


def _as_latex(text: str) -> str:
    """A bare answer (``\\frac{1}{2}``, ``1,000``) in the dollars math-verify looks for."""
    return text if "$" in text or _BOXED.search(text) else f"${text}$"


def _parse(text: str, timeout_s: int) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=timeout_s)


@functools.lru_cache(maxsize=4096)
def _parse_label(label: str, timeout_s: int) -> list[Any]:
    """A label's parse: every sample of a group has the same label (sympy objects are
    immutable, so sharing them is safe)."""
    return _parse(_as_latex(label), timeout_s)


class MathReward:
    """``(response, label, metadata) -> 1.0 | 0.0``: whether the final answer equals the label.

    A class (not a closure) so that reward worker processes can receive it pickled.
    """

    def __init__(self, *, timeout_s: int = 5) -> None:
        if timeout_s < 1:
            raise ValueError(f"math-verify's time limit must be >= 1 s, got {timeout_s}")
        self.timeout_s = timeout_s

    def __call__(self, response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
        if label is None:
            raise ValueError("the math reward needs a label")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "the math reward must run in a main thread: math-verify's time limit is "
                "signal.alarm (use reward.num_workers for worker processes)"
            )
        return 1.0 if self.matches(response, str(label)) else 0.0

    def matches(self, response: str, label: str) -> bool:
        from math_verify import verify

        label = extract_boxed(label) or label
        boxed = extract_boxed(response)
        # Only the last box: math-verify would read "\boxed{7} ... \boxed{8}" as {7, 8}.
        answer = _parse(response if boxed is None else f"\\boxed{{{boxed}}}", self.timeout_s)
        gold = _parse_label(label, self.timeout_s)
        if answer and gold and verify(gold, answer, timeout_seconds=self.timeout_s):
            return True
        return boxed is not None and normalize_text(boxed) == normalize_text(label)


math_reward = MathReward()
"""The math reward with math-verify's default 5 s time limits."""
