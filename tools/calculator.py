"""Exact calculator tool: arithmetic parsed with ``ast`` and evaluated on ``fractions.Fraction``, never ``eval``.

    evaluate("0.1 + 0.2")          # Value(Fraction(3, 10), exact=True)
    format_value(evaluate("1/3"))  # "0.33333333333333333333 (= 1/3)"
    calculator("2**100")           # tool function: "1267650600228229401496703205376"

Grammar: numbers (``12``, ``0.1``, ``1e-3``, ``1_000``; decimal literals are read from their text, so
``0.1`` is exactly 1/10), ``+ - * / // % **``, unary ``+ -``, parentheses, and the functions ``abs``,
``round(x[, digits])``, ``min``, ``max``, ``floor``, ``ceil``, ``sqrt``. ``×`` and ``÷`` are accepted
for ``*`` and ``/``. ``^`` is refused with a hint (in Python it is XOR and binds looser than ``+``, so
reading it as a power would silently change ``2^3+1``).

Results are exact rationals; ``sqrt`` of a non-square and fractional powers are computed with 40
significant digits and the result is marked inexact. Rendering: integers in full; exact finite decimals
in full (``0.3``); other rationals as 20 significant digits plus the fraction (``0.33333333333333333333
(= 1/3)``); inexact results as 20 significant digits.

Limits against abuse (``CalculatorError`` with a clear message): expression length 500, 200 syntax
nodes, integer exponents up to 10,000 in magnitude, and no intermediate numerator or denominator over
20,000 bits (about 6,000 digits). Not supported: variables, assignment, complex numbers, trigonometry,
constants such as pi (their results could not be exact).
"""

from __future__ import annotations

import ast
import decimal
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from tools.registry import ToolResult

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 10_000
MAX_BITS = 20_000
MAX_DECIMAL_EXPONENT = int(MAX_BITS * 0.30103) + 1  # a float literal's power of ten: beyond it, beyond MAX_BITS
_INEXACT_DIGITS = 40
_SHOWN_DIGITS = 20


class CalculatorError(ValueError):
    """The expression is invalid, refused, or has no finite value (message is meant for the model)."""


@dataclass(frozen=True)
class Value:
    number: Fraction
    exact: bool = True


def _check_size(q: Fraction) -> Fraction:
    if q.numerator.bit_length() > MAX_BITS or q.denominator.bit_length() > MAX_BITS:
        raise CalculatorError(f"number too large (over {MAX_BITS} bits, about {int(MAX_BITS * 0.30103):,} digits)")
    return q


def _to_decimal(q: Fraction) -> decimal.Decimal:
    with decimal.localcontext(decimal.Context(prec=_INEXACT_DIGITS)):
        return decimal.Decimal(q.numerator) / decimal.Decimal(q.denominator)


def _exact_root(q: Fraction, n: int) -> Fraction | None:
    """The exact n-th root of a non-negative rational, or None when it is irrational."""
    num, den = q.numerator, q.denominator
    rn, rd = round(num ** (1.0 / n)) if num.bit_length() < 1000 else _int_root(num, n), _int_root(den, n)
    for cand in (rn - 1, rn, rn + 1):
        if cand >= 0 and cand**n == num and rd**n == den:
            return Fraction(cand, rd)
    return None


def _int_root(x: int, n: int) -> int:
    """floor(x ** (1/n)) for integers of any size (Newton's method)."""
    if x < 2:
        return x
    guess = 1 << -(-x.bit_length() // n)
    while True:
        nxt = ((n - 1) * guess + x // guess ** (n - 1)) // n
        if nxt >= guess:
            return guess
        guess = nxt


def _power(base: Value, exp: Value) -> Value:
    b, e = base.number, exp.number
    if e.denominator == 1:
        if abs(e) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {e} is too large (limit {MAX_EXPONENT:,})")
        if b == 0 and e < 0:
            raise CalculatorError("division by zero (0 raised to a negative power)")
        bits = max(b.numerator.bit_length(), b.denominator.bit_length())
        if bits > 1 and bits * abs(int(e)) > MAX_BITS:
            raise CalculatorError(f"result too large (over {MAX_BITS} bits, about {int(MAX_BITS * 0.30103):,} digits)")
        return Value(_check_size(b ** int(e)), base.exact and exp.exact)
    if b < 0:
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if e.denominator <= 64:
        root = _exact_root(b, e.denominator)
        if root is not None:
            return _power(Value(root, base.exact), Value(Fraction(e.numerator), exp.exact))
    if b == 0:
        return Value(Fraction(0), base.exact and exp.exact)
    with decimal.localcontext(decimal.Context(prec=_INEXACT_DIGITS, Emax=999_999, Emin=-999_999)):
        try:
            result = _to_decimal(b) ** _to_decimal(e)
        except decimal.Overflow as exc:
            raise CalculatorError("result too large") from exc
    return Value(_check_size(Fraction(result)), False)


def _sqrt(x: Value) -> Value:
    if x.number < 0:
        raise CalculatorError("sqrt of a negative number is not a real number")
    return _power(x, Value(Fraction(1, 2)))


def _round(x: Value, digits: Value | None = None) -> Value:
    if digits is None:
        return Value(Fraction(round(x.number)), x.exact)
    if digits.number.denominator != 1 or abs(digits.number) > 1000:
        raise CalculatorError("round(x, digits) needs an integer number of digits up to 1000")
    return Value(Fraction(round(x.number, int(digits.number))), x.exact)


def _minmax(pick: Callable[..., Fraction]) -> Callable[..., Value]:
    def f(*args: Value) -> Value:
        if not args:
            raise CalculatorError(f"{pick.__name__}() needs at least one argument")
        chosen = pick(a.number for a in args)
        return Value(chosen, all(a.exact for a in args))

    return f


_FUNCTIONS: dict[str, tuple[Callable[..., Value], int, int]] = {  # name: (function, min args, max args)
    "abs": (lambda x: Value(abs(x.number), x.exact), 1, 1),
    "round": (_round, 1, 2),
    "min": (_minmax(min), 1, 64),
    "max": (_minmax(max), 1, 64),
    "floor": (lambda x: Value(Fraction(math.floor(x.number)), x.exact), 1, 1),
    "ceil": (lambda x: Value(Fraction(math.ceil(x.number)), x.exact), 1, 1),
    "sqrt": (_sqrt, 1, 1),
}


def _binop(op: ast.operator, a: Value, b: Value) -> Value:
    exact = a.exact and b.exact
    x, y = a.number, b.number
    if isinstance(op, ast.Pow):
        return _power(a, b)
    if isinstance(op, ast.Add):
        r = x + y
    elif isinstance(op, ast.Sub):
        r = x - y
    elif isinstance(op, ast.Mult):
        r = x * y
    elif isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
        if y == 0:
            raise CalculatorError("division by zero")
        r = x / y if isinstance(op, ast.Div) else Fraction(x // y) if isinstance(op, ast.FloorDiv) else x % y
    elif isinstance(op, ast.BitXor):
        raise CalculatorError("`^` is not a power here: use `**` (e.g. 2**10)")
    else:
        raise CalculatorError(f"operator {type(op).__name__} is not allowed (use + - * / // % **)")
    return Value(_check_size(r), exact)


class _Evaluator:
    def __init__(self, source: str) -> None:
        self.source = source

    def eval(self, node: ast.AST) -> Value:
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CalculatorError(f"only numbers are allowed, not {value!r}")
            if isinstance(value, int):
                return Value(_check_size(Fraction(value)))
            text = (ast.get_source_segment(self.source, node) or repr(value)).replace("_", "")
            try:
                places = decimal.Decimal(text).adjusted()  # cheap: Fraction("1e999999999") computes 10**999999999 first
            except (ValueError, decimal.InvalidOperation) as exc:
                raise CalculatorError(f"cannot read number {text!r}") from exc
            if abs(places) > MAX_DECIMAL_EXPONENT:
                raise CalculatorError(f"number {text!r} is too large or too small (beyond 10**±{MAX_DECIMAL_EXPONENT:,})")
            try:
                return Value(_check_size(Fraction(text)))
            except (ValueError, ZeroDivisionError) as exc:
                if isinstance(exc, CalculatorError):
                    raise
                raise CalculatorError(f"cannot read number {text!r}") from exc
        if isinstance(node, ast.BinOp):
            return _binop(node.op, self.eval(node.left), self.eval(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            v = self.eval(node.operand)
            return v if isinstance(node.op, ast.UAdd) else Value(-v.number, v.exact)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
                name = node.func.id if isinstance(node.func, ast.Name) else ast.get_source_segment(self.source, node.func)
                raise CalculatorError(f"function {name!r} is not allowed; available: {', '.join(_FUNCTIONS)}")
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise CalculatorError(f"{node.func.id}() takes plain positional arguments only")
            fn, lo, hi = _FUNCTIONS[node.func.id]
            if not lo <= len(node.args) <= hi:
                raise CalculatorError(f"{node.func.id}() takes {lo if lo == hi else f'{lo} to {hi}'} argument(s), got {len(node.args)}")
            return fn(*(self.eval(a) for a in node.args))
        if isinstance(node, ast.Name):
            raise CalculatorError(f"name {node.id!r} is not allowed: only numbers, operators and {', '.join(_FUNCTIONS)}()")
        segment = ast.get_source_segment(self.source, node) or type(node).__name__
        raise CalculatorError(f"{segment!r} is not allowed: only numbers, + - * / // % **, parentheses and {', '.join(_FUNCTIONS)}()")


def evaluate(expression: str) -> Value:
    """Evaluate an arithmetic expression exactly; raises ``CalculatorError`` with a readable message."""
    text = expression.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long ({len(text)} characters, limit {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error at column {exc.offset}: {exc.msg}") from exc
    except ValueError as exc:  # e.g. a literal over Python's int digit limit
        raise CalculatorError(str(exc)) from exc
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise CalculatorError(f"expression too complex ({nodes} syntax nodes, limit {MAX_NODES})")
    return _Evaluator(text).eval(tree)


def _significant(q: Fraction, digits: int = _SHOWN_DIGITS) -> str:
    with decimal.localcontext(decimal.Context(prec=digits)):
        d = decimal.Decimal(q.numerator) / decimal.Decimal(q.denominator)
    text = format(d, "f") if -12 < d.adjusted() < 24 else format(d, "e")
    if "." in text and "e" not in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_value(value: Value) -> str:
    """Render a result: integers and finite decimals in full, other rationals with their fraction."""
    q = value.number
    if not value.exact:
        return _significant(q)
    if q.denominator == 1:
        return str(q.numerator)
    den = q.denominator
    twos = fives = 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    places = max(twos, fives)
    if den == 1 and places <= 60:
        with decimal.localcontext(decimal.Context(prec=q.numerator.bit_length() // 3 + places + 5)):
            return format(decimal.Decimal(q.numerator) / decimal.Decimal(q.denominator), "f")
    return f"{_significant(q)} (= {q.numerator}/{q.denominator})"


def calculator(expression: str) -> ToolResult:
    """Evaluate an arithmetic expression exactly (rational arithmetic, no floating-point error).

    Args:
        expression: Numbers with + - * / // % ** and parentheses; functions abs, round, min, max, floor, ceil, sqrt. Use ** for powers.
    """
    try:
        value = evaluate(expression)
    except CalculatorError as exc:
        return ToolResult.failure("calculator_error", f"error: {exc}")
    return ToolResult(content=format_value(value), flags={"exact": value.exact})
