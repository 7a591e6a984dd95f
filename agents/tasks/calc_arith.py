"""``calc_arith``: multi-step integer arithmetic meant to be solved with a calculator tool.

A problem is a left-to-right chain ``((a op b) op c) op d`` written with brackets, e.g.
"Compute ((7 + 5) * 3) - 4.", with ``n_ops`` operations drawn from ``ops`` and operands drawn from
``[min_operand, max_operand]`` (multipliers are capped at ``max_multiplier`` so values stay readable).
Intermediate results never go negative unless ``allow_negative=True`` (a subtraction that would is
turned into an addition). The prompt asks the agent to use the calculator for each step and to answer
as ``<answer>N</answer>``; with ``use_tools=False`` it asks for step-by-step work instead and the task
lists no tools (that is how the no-tool baseline is measured).

Defaults: ``n_ops=(1, 2)`` (each problem draws one or two operations; an int fixes the count, a string
"1-3" is a range), operands 2–20, ``+ - *``, multipliers ≤ 9. Calibrated with SmolLM2-135M-Instruct
answering without tools (``python -m agents.tasks.calibrate``, greedy, seed 0): one operation 21/50 =
42 % (160 new tokens) and 5/25 = 20 % (the one-step half of the default mix, 128 new tokens); two
operations 4/50 = 8 %, and 1/20 with operands ≤ 9; the default mix 7/50 = 14 %. Two steps without a
calculator are nearly out of reach for the model, one step is in the 15–60 % band, so the default mixes
them: about half of the problems are multi-step, and the calculator should lift those. The
agent-loop calibration with the tool decides the final default; ``n_ops`` (and ``max_operand``) are
the knobs.

Verification: the final answer is extracted (``<answer>``, ``\\boxed``, "final answer:", else the last
number) and compared exactly with the chain's value. Process score per turn: 1.0 if a calculator
expression in the turn evaluates to one of the chain's intermediate results (or, in a turn without a
calculator call, if the turn's answer is the final value), else 0.0.

PATR's process scorer (``score_prefix``): the fraction of the chain's intermediate results that some
turn's calculator expression has produced so far, or 1.0 once a turn's answer is the final value.
``signature`` (RODS's variants): the chain's operations in order (``"+*"``): the same tool-call graph.

What this module does not do: it does not run the calculator tool itself (the agent loop does) and does
not parse a particular tool-call syntax strictly; it finds quoted arithmetic in turns that mention the
calculator, whatever the tool-call format.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .answers import canonical_number, extract_answer, extract_number, parse_number
from .arith import ArithError, evaluate, looks_like_expression
from .base import PrefixState, Problem, TaskBase, Verdict

__all__ = ["CalcArithConfig", "CalcArithTask"]

_SEED_STRIDE = 1_000_003
_QUOTED_RE = re.compile(r"\"((?:[^\"\\]|\\.){1,300})\"|'([^'\n]{1,300})'")
_OP_NAMES = {"+": "add", "-": "subtract", "*": "multiply"}


@dataclass(frozen=True)
class CalcArithConfig:
    n_ops: int | tuple[int, int] = (1, 2)  # operations per problem: a fixed count or an inclusive range drawn per problem
    min_operand: int = 2
    max_operand: int = 20
    max_multiplier: int = 9
    ops: tuple[str, ...] = ("+", "-", "*")
    allow_negative: bool = False
    use_tools: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.ops_range
        if not 1 <= lo <= hi <= 12:
            raise ValueError(f"n_ops must be an integer or a (min, max) range within [1, 12], got {self.n_ops!r}")
        if not 0 <= self.min_operand <= self.max_operand <= 10**9:
            raise ValueError(f"need 0 <= min_operand <= max_operand <= 1e9, got {self.min_operand}..{self.max_operand}")
        if self.max_multiplier < max(self.min_operand, 1):
            raise ValueError(f"max_multiplier ({self.max_multiplier}) must be at least min_operand ({self.min_operand}) and 1")
        bad = [op for op in self.ops if op not in _OP_NAMES]
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty subset of {sorted(_OP_NAMES)}, got {self.ops!r}")

    @property
    def ops_range(self) -> tuple[int, int]:
        if isinstance(self.n_ops, int) and not isinstance(self.n_ops, bool):
            return (self.n_ops, self.n_ops)
        if isinstance(self.n_ops, tuple | list) and len(self.n_ops) == 2 and all(isinstance(x, int) for x in self.n_ops):
            return (int(self.n_ops[0]), int(self.n_ops[1]))
        return (0, -1)  # invalid; __post_init__ reports it


class CalcArithTask(TaskBase):
    """Multi-step calculator arithmetic; see the module docstring for the knobs and defaults."""

    def __init__(self, *, name: str = "calc_arith", **options: Any) -> None:
        if "ops" in options and isinstance(options["ops"], str):
            options["ops"] = tuple(options["ops"].replace(",", "").replace(" ", ""))
        elif "ops" in options:
            options["ops"] = tuple(options["ops"])
        n_ops = options.get("n_ops")
        if isinstance(n_ops, str):  # "2" or "1-3" from a command line
            lo, _, hi = n_ops.partition("-")
            try:
                options["n_ops"] = (int(lo), int(hi or lo))
            except ValueError as exc:
                raise ValueError(f"{name}: n_ops must look like '2' or '1-3', got {n_ops!r}") from exc
        elif isinstance(n_ops, list):
            options["n_ops"] = tuple(n_ops)
        try:
            self.config = CalcArithConfig(**options)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        self.name = name
        self.tools = ("calculator",) if self.config.use_tools else ()
        self.description = (
            f"Multi-step integer arithmetic ({_ops_text(self.config.ops_range)} operations of {' '.join(self.config.ops)}, "
            f"operands {self.config.min_operand}-{self.config.max_operand})"
            + (", one calculator call per step." if self.config.use_tools else ", without tools.")
        )

    # ---- generation -------------------------------------------------------------------------------

    def _make(self, rng: random.Random) -> tuple[str, list[dict[str, Any]], int]:
        cfg = self.config
        value = rng.randint(cfg.min_operand, cfg.max_operand)
        expr = str(value)
        steps: list[dict[str, Any]] = []
        lo, hi = cfg.ops_range
        n_ops = rng.randint(lo, hi) if hi > lo else lo
        for k in range(n_ops):
            op = rng.choice(cfg.ops)
            if op == "*":
                operand = rng.randint(max(cfg.min_operand, 1), cfg.max_multiplier)
            else:
                operand = rng.randint(cfg.min_operand, cfg.max_operand)
            if op == "-" and value - operand < 0 and not cfg.allow_negative:
                op = "+"
            new = value + operand if op == "+" else value - operand if op == "-" else value * operand
            steps.append({"expression": f"{value} {op} {operand}", "value": new})
            expr = f"({expr}) {op} {operand}" if k > 0 else f"{expr} {op} {operand}"
            value = new
        return expr, steps, value

    def _prompt(self, expr: str) -> str:
        if self.config.use_tools:
            how = "Use the calculator tool for each step, then give the final answer as <answer>N</answer>."
        else:
            how = "Work it out step by step, then give the final answer as <answer>N</answer>."
        return f"Compute {expr}.\n{how}"

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self._check_n(n)
        out = []
        for i in range(n):
            rng = random.Random(seed * _SEED_STRIDE + i)
            expr, steps, value = self._make(rng)
            out.append(
                Problem(
                    task=self.name,
                    id=f"{self.name}/s{seed}/{i}",
                    prompt=self._prompt(expr),
                    answer=value,
                    metadata={
                        "seed": seed,
                        "index": i,
                        "expression": expr,
                        "steps": steps,
                        "intermediate_values": [s["value"] for s in steps],
                        "n_ops": len(steps),
                    },
                )
            )
        return out

    # ---- verification -----------------------------------------------------------------------------

    def verify(self, problem: Problem, answer: str) -> Verdict:
        if not isinstance(answer, str) or not answer.strip():
            return Verdict(0.0, False, "empty answer").shown()
        gold = Fraction(int(problem.answer))
        got = extract_number(answer)
        if got is None:
            return Verdict(0.0, False, "no numeric answer found").shown()
        if got == gold:
            return Verdict(1.0, True, f"correct: {canonical_number(gold)}").shown()
        shown = canonical_number(got)
        return Verdict(0.0, False, f"expected {canonical_number(gold)}, got {shown}", feedback=f"{shown} is not correct")

    def process_score(self, problem: Problem, turn_text: str) -> float | None:
        """1.0 if the turn's calculator expression hits an intermediate result (or its answer is right), else 0.0."""
        if not isinstance(turn_text, str) or not turn_text.strip():
            return 0.0
        wanted = {Fraction(int(v)) for v in problem.metadata.get("intermediate_values", [])} | {Fraction(int(problem.answer))}
        expressions = calculator_expressions(turn_text)
        if expressions:
            for expr in expressions:
                try:
                    if evaluate(expr) in wanted:
                        return 1.0
                except ArithError:
                    continue
            return 0.0
        candidate = extract_answer(turn_text, numeric=True)  # as the verifier reads a final answer: else the last number
        value = parse_number(candidate) if candidate is not None else None
        if value is None and candidate is not None:
            value = extract_number(candidate)
        return 1.0 if value is not None and value == Fraction(int(problem.answer)) else 0.0

    def score_prefix(self, problem: Problem, state: PrefixState) -> float | None:
        """Partial progress of a run so far (module docstring)."""
        values = [Fraction(int(v)) for v in problem.metadata.get("intermediate_values", [])]
        if not values:
            return None
        hit: set[Fraction] = set()
        for text in state.turns:
            if not isinstance(text, str):
                continue
            expressions = calculator_expressions(text)
            if not expressions and self.process_score(problem, text) == 1.0:
                return 1.0  # a turn without a calculator call whose answer is the final value
            for expr in expressions:
                try:
                    hit.add(evaluate(expr))
                except ArithError:
                    continue
        return sum(1 for v in set(values) if v in hit) / len(set(values))

    def signature(self, problem: Problem) -> str | None:
        """The chain's operations in order, e.g. ``"+*"``."""
        return "".join(str(s["expression"]).split()[1] for s in problem.metadata.get("steps", []))


def _ops_text(ops_range: tuple[int, int]) -> str:
    lo, hi = ops_range
    return str(lo) if lo == hi else f"{lo}-{hi}"


def calculator_expressions(text: str) -> list[str]:
    """Arithmetic expressions passed to a calculator in ``text``, in any common tool-call format.

    Looks for JSON objects (``{"name": "calculator", "arguments": {"expression": "3*4"}}``,
    ``<tool_call>…</tool_call>``), Python-style calls (``calculator(expression="3*4")``,
    ``calculator("3*4")``), and falls back to any quoted arithmetic when the text mentions a calculator.
    """
    if "calc" not in text.lower():
        return []
    found: list[str] = []
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        found.extend(_strings_in(obj))
    for m in _QUOTED_RE.finditer(text):
        found.append(m.group(1) if m.group(1) is not None else m.group(2))
    seen: set[str] = set()
    out = []
    for s in found:
        s = s.strip()
        if s not in seen and looks_like_expression(s) and re.search(r"\d\s*[-+*/×÷^%]\s*[\d(]", s):
            seen.add(s)
            out.append(s)
    return out


def _strings_in(obj: Any, depth: int = 0) -> list[str]:
    if depth > 6:
        return []
    if isinstance(obj, str):
        if obj.lstrip().startswith("{"):  # OpenAI-style arguments: a JSON string inside JSON
            try:
                return _strings_in(json.loads(obj), depth + 1)
            except json.JSONDecodeError:
                return [obj]
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings_in(v, depth + 1)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings_in(v, depth + 1)]
    return []
