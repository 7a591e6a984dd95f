"""Calculator: exact rational results, rendering, refusals with clear messages, abuse limits."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import pytest

from tools import ToolRegistry
from tools.calculator import CalculatorError, calculator, evaluate, format_value


@pytest.mark.parametrize(
    ("expression", "rendered"),
    [
        ("0.1 + 0.2", "0.3"),
        ("0.1 + 0.2 - 0.3", "0"),
        ("2**100", "1267650600228229401496703205376"),
        ("1/3", "0.33333333333333333333 (= 1/3)"),
        ("2/3", "0.66666666666666666667 (= 2/3)"),
        ("10/4", "2.5"),
        ("1/8", "0.125"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("7.5 % 2", "1.5"),
        ("(1 + 2) * 3 - -4", "13"),
        ("+5", "5"),
        ("2 ** -2", "0.25"),
        ("1e-3 * 3", "0.003"),
        ("1_000 * 3", "3000"),
        ("3 × 4 ÷ 6", "2"),
        ("abs(-2.5)", "2.5"),
        ("round(2.675, 2)", "2.68"),  # exact decimal input, so no float surprise (float gives 2.67)
        ("round(2.5)", "2"),  # Python's round-half-even
        ("min(3, 1/2, 2)", "0.5"),
        ("max(1, 2.5, 3/2)", "2.5"),
        ("floor(-2.5) + ceil(2.1)", "0"),
        ("sqrt(16/9)", "1.3333333333333333333 (= 4/3)"),
        ("sqrt(144)", "12"),
        ("8 ** (1/3)", "2"),
        ("sqrt(2)", "1.4142135623730950488"),
        ("2 ** 0.5", "1.4142135623730950488"),
        ("1 / 2**100", "7.8886090522101180541e-31 (= 1/1267650600228229401496703205376)"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_exact_results_and_rendering(expression: str, rendered: str) -> None:
    assert format_value(evaluate(expression)) == rendered


def test_exactness_flag() -> None:
    assert evaluate("0.1 + 0.2").number == Fraction(3, 10)
    assert evaluate("1/3").exact and evaluate("sqrt(4)").exact
    assert not evaluate("sqrt(2)").exact
    assert evaluate("2**200").number == 2**200


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("5 // (2 - 2)", "division by zero"),
        ("3 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("__import__('os')", "function '__import__' is not allowed"),
        ("__import__('os').system('echo hi')", "is not allowed"),
        ("().__class__.__bases__[0]", "is not allowed"),
        ("x + 1", "name 'x' is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("[1, 2]", "is not allowed"),
        ("lambda: 1", "is not allowed"),
        ("2 ^ 10", "use `**`"),
        ("1 << 10", "operator LShift is not allowed"),
        ("1 +", "syntax error"),
        ("", "empty expression"),
        ("2 ** 100000", "exponent 100000 is too large"),
        ("10 ** 9999", "result too large"),
        ("9 ** 9 ** 9", "too large"),
        ("1e999999999", "too large or too small"),  # Fraction() of the literal computed 10**999999999 first: minutes to hours
        ("1e-999999999 + 1", "too large or too small"),
        ("2.5e6100", "too large or too small"),
        ("(-8) ** (1/3)", "not a real number"),
        ("sqrt(-1)", "not a real number"),
        ("max()", "max() takes 1 to 64 argument(s), got 0"),
        ("round(1.5, digits=1)", "positional arguments only"),
        ("1" + "+1" * 300, "expression too long"),
        ("+" * 120 + "1" + "*1" * 80, "too complex"),
    ],
)
def test_refusals_have_clear_messages(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert message in str(info.value)


def test_growth_by_repeated_multiplication_is_bounded() -> None:
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match="too large"):
        evaluate("*".join(["(2**9000)"] * 5))
    assert time.perf_counter() - started < 1.0


def test_calculator_as_a_registered_tool() -> None:
    registry = ToolRegistry()
    registry.register(calculator)
    schema = registry.schemas()[0]["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert "**" in schema["parameters"]["properties"]["expression"]["description"]

    async def main() -> list:
        return [await registry.call("calculator", args) for args in ('{"expression": "0.1+0.2"}', {"expression": "1/0"}, {"expression": 12})]

    ok, div0, wrong_type = asyncio.run(main())
    assert (ok.ok, ok.content, ok.flags) == (True, "0.3", {"exact": True})
    assert (div0.ok, div0.error_kind, div0.content) == (False, "calculator_error", "error: division by zero")
    assert (wrong_type.ok, wrong_type.error_kind) == (False, "invalid_arguments")
    assert "`expression`" in wrong_type.content
