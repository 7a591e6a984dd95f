"""Answer extraction, number normalization and the safe arithmetic evaluator used by the task verifiers."""

from __future__ import annotations

from fractions import Fraction

import pytest

from agents.tasks.answers import canonical_number, extract_answer, extract_number, last_boxed, last_number, parse_number
from agents.tasks.arith import ArithError, evaluate, looks_like_expression


@pytest.mark.parametrize(
    ("text", "numeric", "expected"),
    [
        ("<answer>42</answer>", False, "42"),
        ("first <answer>1</answer> then <answer> 2 </answer>", False, "2"),  # the last tag wins
        ("<ANSWER>7</ANSWER>", False, "7"),
        ("<solution>x = 3</solution>", False, "x = 3"),
        ("<answer>5</answer> and later <solution>6</solution>", False, "6"),  # the last of either tag
        ("thinking... <answer>17", False, "17"),  # generation stopped at the closing tag
        ("so \\boxed{12} done", False, "12"),
        ("\\boxed{\\frac{3}{4}}", False, "\\frac{3}{4}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", False, "2"),
        ("Final answer: 99.", False, "99"),
        ("The final answer is **-4**", False, "-4"),
        ("so the answer is 12 apples", False, "12 apples"),
        ("<answer>3</answer> \\boxed{4}", False, "3"),  # tags win over boxed
        ("I computed 3 and then 5", False, None),
        ("I computed 3 and then 5", True, "5"),
        ("result: 1,234,567 units", True, "1,234,567"),
        ("5 - 3", True, "3"),  # a binary minus is not a sign
        ("we get -3", True, "-3"),
        ("", True, None),
        ("no numbers here", True, None),
    ],
)
def test_extract_answer(text: str, numeric: bool, expected: str | None) -> None:
    assert extract_answer(text, numeric=numeric) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", Fraction(42)),
        ("-42", Fraction(-42)),
        ("+7", Fraction(7)),
        ("1,000", Fraction(1000)),
        ("1,000.0", Fraction(1000)),
        ("12.0", Fraction(12)),
        ("12.", Fraction(12)),
        ("0.75", Fraction(3, 4)),
        ("3/4", Fraction(3, 4)),
        ("6 / 8", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("$5", Fraction(5)),
        ("−8", Fraction(-8)),  # unicode minus
        ("1e3", Fraction(1000)),
        ("1/0", None),
        ("12 apples", None),
        ("1,00", None),
        ("", None),
        ("abc", None),
        ("9" * 1000, None),  # absurdly long
    ],
)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


def test_canonical_number_and_extract_number() -> None:
    assert canonical_number(Fraction(42)) == "42"
    assert canonical_number(Fraction(-6, 8)) == "-3/4"
    assert extract_number("<answer>x = 41</answer>") == Fraction(41)  # last number inside the answer
    assert extract_number("It is 12.50 dollars, so <answer>12.5</answer>") == Fraction(25, 2)
    assert extract_number("step 1: 3 + 4 = 7\nstep 2: 7 * 2 = 14") == Fraction(14)
    assert extract_number("<answer>none</answer>") is None
    assert last_number("a 1.5.") == "1.5"
    assert last_boxed("\\boxed{unclosed") is None


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", Fraction(7)),
        ("(12 + 3) * 4 / 5", Fraction(12)),
        ("7 / 2", Fraction(7, 2)),
        ("-(3 - 5)", Fraction(2)),
        ("2 ^ 10", Fraction(1024)),
        ("6 × 7 ÷ 2", Fraction(21)),
        ("1,000 + 1", Fraction(1001)),
        ("17 // 5 + 17 % 5", Fraction(5)),
        ("0.5 + 0.25", Fraction(3, 4)),
    ],
)
def test_evaluate(expr: str, value: Fraction) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "x + 1", "1 / 0", "2 ** 100000", "9 ** 9 ** 9", "(" * 400 + "1" + ")" * 400, "", "1 +", "'a' * 3", "1e999"],
)
def test_evaluate_refuses(expr: str) -> None:
    with pytest.raises(ArithError):
        evaluate(expr)


def test_looks_like_expression() -> None:
    assert looks_like_expression("(3 + 4) * 2")
    assert not looks_like_expression("calculator")
    assert not looks_like_expression("+-")
