"""The ``calculator`` tool: an arithmetic expression in, its value out.

The expression is parsed with ``ast`` and only numbers, parentheses and the operators
``+ - * / // % **`` (and unary signs) are evaluated; anything else (names, calls,
attributes) is refused. Exponents and magnitudes are bounded, so ``9**9**9`` is an error
and not an hour of work.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
MAX_LENGTH = 200

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate."""


def _value(node: ast.AST) -> float:  # int stays int: exact integer arithmetic
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value: float = node.value  # type: ignore[assignment]
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is above {MAX_EXPONENT}")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise CalculatorError("the result is out of range")
        return result
    raise CalculatorError(f"'{ast.unparse(node)}' is not arithmetic on numbers")


def format_number(value: float) -> str:
    """Integers without a decimal point; other values to 10 significant digits."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.10g}"


def calculator(expression: str) -> str:
    """The value of ``expression`` as text; a CalculatorError says why it has none."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression.strip()!r}") from None
    try:
        return format_number(_value(tree.body))
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
