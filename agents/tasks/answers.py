"""Answer extraction and number normalization shared by the task verifiers.

``extract_answer`` finds the part of a model message that is meant as the final answer, in this order
of preference:

1. the content of the last ``<answer>…</answer>`` (``<solution>…</solution>`` is tolerated the same
   way); an opening tag that is never closed (generation stopped at the closing tag) runs to the end;
2. the content of the last ``\\boxed{…}`` (nested braces handled);
3. the rest of the line after the last "final answer: X" / "final answer is X" / "the answer is X";
4. for numeric tasks only (``numeric=True``): the last number anywhere in the text.

``parse_number`` turns answer text into an exact ``Fraction`` (commas as thousands separators, ``$``,
a leading ``+``, trailing ``.0``/``.``, unicode minus, ``3/4``, ``\\frac{3}{4}``, ``1e3``);
``canonical_number`` writes a ``Fraction`` back as ``"42"`` or ``"3/4"``; ``extract_number`` combines
the two for numeric tasks.

What this module does not do: it never evaluates expressions (see ``agents.tasks.arith`` for that), it
does not understand units or words ("forty-two"), and it does not decide correctness; the tasks do.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "NUMBER_RE",
    "canonical_number",
    "extract_answer",
    "extract_number",
    "extract_tag",
    "last_boxed",
    "last_number",
    "numbers_equal",
    "parse_number",
]

_TAG_NAMES = ("answer", "solution")
_FINAL_RE = re.compile(r"(?:final\s+answer|the\s+answer)\s*(?:is\s*:?|:|=)\s*(?P<rest>[^\n]*)", re.IGNORECASE)
# a number: thousands-grouped or plain, optional decimals, optional /denominator, optional leading minus
# (``last_number`` drops a minus that is really a binary operator, as in "5 - 3" or "5-3")
NUMBER_RE = re.compile(r"(?<![\w.])[-−]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s?/\s?\d+)?")
_FRAC_LATEX_RE = re.compile(r"^\\[dt]?frac\{\s*([^{}]+?)\s*\}\{\s*([^{}]+?)\s*\}$")
_MAX_NUMBER_CHARS = 400  # refuse absurd inputs (e.g. "1e999999999" would build a huge integer)


def extract_tag(text: str, names: tuple[str, ...] = _TAG_NAMES) -> str | None:
    """Content of the last ``<name>…</name>`` for any of ``names``; an unclosed last opening tag runs to the end."""
    best: tuple[int, str] | None = None
    for name in names:
        open_re = re.compile(rf"<\s*{name}\s*>", re.IGNORECASE)
        close_re = re.compile(rf"<\s*/\s*{name}\s*>", re.IGNORECASE)
        opens = list(open_re.finditer(text))
        if not opens:
            continue
        last = opens[-1]
        close = close_re.search(text, last.end())
        content = text[last.end() : close.start()] if close else text[last.end() :]
        if best is None or last.start() > best[0]:
            best = (last.start(), content.strip())
    return best[1] if best else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), with balanced braces; None if there is none or it is unclosed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _final_answer_phrase(text: str) -> str | None:
    matches = list(_FINAL_RE.finditer(text))
    if not matches:
        return None
    rest = matches[-1].group("rest").strip()
    rest = re.sub(r"^[*_`\s]+|[*_`\s]+$", "", rest)  # markdown emphasis around the value
    rest = rest.rstrip(".").strip()
    return rest or None


def last_number(text: str) -> str | None:
    """The last number-looking substring of ``text`` (see ``NUMBER_RE``), or None."""
    matches = list(NUMBER_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    number = m.group(0)
    if number[0] in "-−":
        before = text[: m.start()].rstrip()
        if before and (before[-1].isdigit() or before[-1] in ")]}"):
            number = number[1:]  # "5 - 3": a binary minus, not a sign
    return number.strip()


def extract_answer(text: str | None, *, numeric: bool = False) -> str | None:
    """The final-answer part of ``text`` (see the module docstring for the order of preference); None if none is found."""
    if not text:
        return None
    for candidate in (extract_tag(text), last_boxed(text), _final_answer_phrase(text)):
        if candidate is not None:
            return candidate
    if numeric:
        return last_number(text)
    return None


def parse_number(text: str | None) -> Fraction | None:
    """Exact value of a number written as text, or None if ``text`` is not a single number."""
    if text is None:
        return None
    s = text.strip()
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    s = s.replace("−", "-").replace("$", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()  # \( 42 \)
    s = s.rstrip(".").strip()
    m = _FRAC_LATEX_RE.match(s)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return num / den if num is not None and den not in (None, 0) else None
    if re.fullmatch(r"[-+]?\s?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    if s.startswith("+"):
        s = s[1:]
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?(?:/-?\d+)?", s):
        return None
    try:
        if "/" in s:
            num_s, den_s = s.split("/")
            den = Fraction(den_s)
            return Fraction(num_s) / den if den != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def canonical_number(value: Fraction) -> str:
    """``Fraction(42)`` → ``"42"``, ``Fraction(3, 4)`` → ``"3/4"``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def extract_number(text: str | None) -> Fraction | None:
    """The numeric final answer in ``text``: the extracted answer parsed whole, else the last number inside it, else None."""
    answer = extract_answer(text, numeric=True)
    if answer is None:
        return None
    value = parse_number(answer)
    if value is not None:
        return value
    return parse_number(last_number(answer))


def numbers_equal(a: Fraction | None, b: Fraction | None) -> bool:
    return a is not None and b is not None and a == b
