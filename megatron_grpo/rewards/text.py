"""Rewards on the response text itself: exact match against the label, and a format regex."""

from __future__ import annotations

import re
from typing import Any, Literal


def normalize_whitespace(text: str) -> str:
    return " ".join(text.split())


def exact_match(
    response: str, label: Any, metadata: Any = None, *, case_sensitive: bool = True
) -> float:
    """1.0 when the response equals the label up to whitespace (and case, if asked)."""
    if label is None:
        raise ValueError("the exact_match reward needs a label")
    a, b = normalize_whitespace(response), normalize_whitespace(str(label))
    if not case_sensitive:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


class FormatReward:
    """``match_score`` when the response matches ``pattern``, else ``miss_score``.

    The pattern is compiled with DOTALL: responses span lines, and ``.*``
    between two tags should too.
    """

    def __init__(
        self,
        pattern: str,
        *,
        mode: Literal["fullmatch", "search"] = "fullmatch",
        match_score: float = 1.0,
        miss_score: float = 0.0,
    ) -> None:
        self.regex = re.compile(pattern, re.DOTALL)
        self.mode = mode
        self.match_score = match_score
        self.miss_score = miss_score

    def __call__(self, response: str, label: Any = None, metadata: Any = None) -> float:
        if self.mode == "fullmatch":
            matched = self.regex.fullmatch(response) is not None
        else:
            matched = self.regex.search(response) is not None
        return self.match_score if matched else self.miss_score
