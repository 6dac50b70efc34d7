"""Math answer verification: pull the final answer out of a response and compare it to the label.

The answer is the content of the last balanced ``\\boxed{...}``, else the last
number in the text. Numbers are compared exactly as fractions (so ``0.5`` equals
``1/2`` and ``\\frac{1}{2}``), with a relative tolerance for rounded decimals;
anything that is not a number is compared as a normalized string.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

REL_TOL = Fraction(1, 10**6)
"""Relative tolerance for numbers: a rounded 0.333333 still equals 1/3."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

# A sign counts only where it cannot be a binary minus: "3-5" ends in 5, not -5.
_SIGN = r"(?:(?<![\w)\]}])[-+])?"
_NUMBER = re.compile(
    rf"{_SIGN}(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
    rf"|{_SIGN}\.\d+"
)
_PLAIN_NUMBER = re.compile(r"[-+]?\s*(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?(?:[eE][-+]?\d+)?")
_LATEX_FRAC = re.compile(r"([-+]?)\\frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}")
_SLASH_FRAC = re.compile(r"([^/]+)/([^/]+)")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*\s*=\s*")

# Markup that never changes the value; "{,}" and "\," are LaTeX thousands separators.
_NOISE = (
    "\\left",
    "\\right",
    "\\displaystyle",
    "\\!",
    "\\,",
    "\\;",
    "{,}",
    "^{\\circ}",
    "^\\circ",
    "\\%",
    "%",
    "\\$",
    "$",
)


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


def last_number(text: str) -> str | None:
    """The last number in the text (integer, decimal, ``1,000`` or ``a/b``), as written."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last boxed expression, else the last number."""
    boxed = extract_boxed(response)
    return boxed if boxed is not None else last_number(response)


def _strip_markup(text: str, *, drop_text: bool) -> str:
    """Text without value-neutral markup; ``\\text{..}`` is unwrapped, or dropped (units)."""
    text = _TEXT_CMD.sub("" if drop_text else r"\1", text)
    for token in _NOISE:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\u2212", "-")  # Unicode minus sign
    return text.strip().rstrip(".").strip()


def _plain_number(text: str) -> Fraction | None:
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text) or not any(c.isdigit() for c in text):
        return None
    return Fraction(text.replace(",", "").replace(" ", ""))


def _number(text: str) -> Fraction | None:
    text = _ASSIGNMENT.sub("", text)
    if m := _LATEX_FRAC.fullmatch(text):
        sign, num, den = m.group(1), _plain_number(m.group(2)), _plain_number(m.group(3))
    elif m := _SLASH_FRAC.fullmatch(text):
        sign, num, den = "", _plain_number(m.group(1)), _plain_number(m.group(2))
    else:
        return _plain_number(text)
    if num is None or den is None or den == 0:
        return None
    return -num / den if sign == "-" else num / den


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer, or None if it is not a plain number."""
    value = _number(_strip_markup(text, drop_text=False))
    if value is None:  # maybe a number followed by a unit: "5\text{ cm}"
        value = _number(_strip_markup(text, drop_text=True))
    return value


def normalize_text(text: str) -> str:
    """A non-numeric answer for string comparison: no markup, no whitespace, no final period."""
    return "".join(_strip_markup(text, drop_text=False).split())


def answers_match(answer: str, label: Any) -> bool:
    """Whether an extracted answer equals the label, numerically or as normalized text."""
    label_text = str(label)
    label_text = extract_boxed(label_text) or label_text
    a, b = parse_number(answer), parse_number(label_text)
    if a is not None and b is not None:
        return abs(a - b) <= REL_TOL * max(abs(a), abs(b))
    return normalize_text(answer) == normalize_text(label_text)


def math_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 when the response's final answer equals the label, else 0.0."""
    if label is None:
        raise ValueError("the math reward needs a label")
    answer = extract_answer(response)
    return 1.0 if answer is not None and answers_match(answer, label) else 0.0
