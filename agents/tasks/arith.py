"""Exact, safe evaluation of small arithmetic expressions for verifiers (never ``eval``).

``evaluate("(12 + 3) * 4 / 5")`` parses with ``ast`` in ``eval`` mode and walks only number literals,
``+ - * / // % **`` and unary ``+ -``, computing with ``fractions.Fraction`` so ``7 / 2`` is exactly
``7/2``. ``×``/``÷``/``^`` are accepted as ``*``/``/``/``**``. Anything else (names, calls, attributes,
strings, comparisons) raises ``ArithError``, as do division by zero and results that would be huge
(exponents above ``MAX_EXPONENT``, integers longer than ``MAX_DIGITS`` digits, input over
``MAX_CHARS`` characters).

``looks_like_expression`` is a cheap pre-filter for text found in model output.

What this module does not do: no variables, functions, floats with rounding, or units. It is the
verifiers' checker, not the agent's calculator tool (that lives in ``tools/``).
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

__all__ = ["MAX_CHARS", "MAX_DIGITS", "MAX_EXPONENT", "ArithError", "evaluate", "looks_like_expression"]

MAX_CHARS = 500
MAX_DIGITS = 200
MAX_EXPONENT = 64
_ALLOWED_CHARS_RE = re.compile(r"^[\d\s+\-*/%().×÷^,]+$")


class ArithError(ValueError):
    """The text is not a supported arithmetic expression, or evaluating it failed (division by zero, too large)."""


def looks_like_expression(text: str) -> bool:
    """True if ``text`` has only digits, operators, brackets and spaces, and at least one digit."""
    return bool(text) and len(text) <= MAX_CHARS and bool(_ALLOWED_CHARS_RE.match(text)) and any(c.isdigit() for c in text)


def _check_size(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise ArithError(f"result has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        if isinstance(node.value, float):
            if not math.isfinite(node.value):
                raise ArithError("number out of range")
            return _check_size(Fraction(str(node.value)))
        return _check_size(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        op = node.op
        if isinstance(op, ast.Add):
            return _check_size(left + right)
        if isinstance(op, ast.Sub):
            return _check_size(left - right)
        if isinstance(op, ast.Mult):
            return _check_size(left * right)
        if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
            if right == 0:
                raise ArithError("division by zero")
            if isinstance(op, ast.Div):
                return _check_size(left / right)
            return Fraction(left // right) if isinstance(op, ast.FloorDiv) else _check_size(left % right)
        if isinstance(op, ast.Pow):
            if right.denominator != 1:
                raise ArithError("only integer exponents are supported")
            if abs(right) > MAX_EXPONENT:
                raise ArithError(f"exponent above {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ArithError("division by zero")
            return _check_size(left ** int(right))
    raise ArithError(f"unsupported syntax: {type(node).__name__}")


def evaluate(text: str) -> Fraction:
    """Exact value of the arithmetic expression ``text``; raises ``ArithError`` for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise ArithError("empty expression")
    if len(text) > MAX_CHARS:
        raise ArithError(f"expression longer than {MAX_CHARS} characters")
    src = text.strip().replace("×", "*").replace("÷", "/").replace("^", "**").replace("−", "-")
    if re.search(r"\d,\d{3}", src):
        src = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", src)  # thousands separators
    try:
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise ArithError(f"not an arithmetic expression: {exc.msg if isinstance(exc, SyntaxError) else exc}") from exc
    except RecursionError as exc:
        raise ArithError("expression nested too deeply") from exc
    try:
        return _eval(tree)
    except RecursionError as exc:
        raise ArithError("expression nested too deeply") from exc
