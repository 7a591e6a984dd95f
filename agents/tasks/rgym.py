"""reasoning-gym generators as tasks: seeded problems and verification through the generator's ``score_answer``.

``ReasoningGymTask("basic_arithmetic", **config)`` wraps ``reasoning_gym.create_dataset(name, size=n,
seed=..., **config)``; ``config`` is the generator's own config (e.g. ``max_terms=3, max_digits=1`` for
basic_arithmetic) and is validated when the task is built. The four built-in names use reasoning-gym's
default difficulty; any other generator is reachable as ``rg:<name>`` through the registry.

Seeds: reasoning-gym derives item ``i`` from ``Random(seed + i)``, so its seeds 0 and 1 share all but one
item. We pass ``seed * 1_000_003`` instead, so different task seeds give disjoint problem lists (for
``n`` below a million); ``problems(n, seed)`` is a prefix of ``problems(n + k, seed)``.

Verification: the answer is extracted from the message (``agents.tasks.answers``), normalized, and handed
to the dataset's ``score_answer``:

* numeric generators (basic_arithmetic, chain_sum, gsm_symbolic): the extracted number, written
  canonically ("1,000.0" → "1000"), because basic_arithmetic's scorer compares strings exactly;
* countdown: the expression inside the answer tags (or the whole reply if it is a bare expression);
  a trailing "= target" is dropped; only digits, ``+ - * /``, brackets and spaces are accepted (the
  scorer parses with sympy, which would evaluate arbitrary Python), at most 200 characters;
* other generators: the extracted answer text, or the whole reply stripped.

reasoning-gym gives partial scores for wrong answers (0.01 for a wrong number, 0.05 for a countdown
expression with the wrong numbers); by default ``reward`` is 1.0 when the score is 1.0 and 0.0
otherwise, so a wrong answer gets no reward. ``partial_credit=True`` passes the raw score through.
``correct`` is always "score == 1".

``signature`` (RODS's variants): the generator's own structure parameters of the item where its metadata
has them (``num_terms``/``num_digits`` for basic_arithmetic and chain_sum, how many ``numbers`` for
countdown); None otherwise (any problem of the same generator config is a variant).

What this module does not do: no few-shot prompting, no chain-of-thought parsing beyond answer
extraction, and no curriculum (reasoning-gym's ``coaching`` module is not used).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import structlog

from .answers import canonical_number, extract_answer, extract_number, parse_number
from .arith import ArithError, evaluate
from .base import Problem, TaskBase, Verdict

__all__ = ["BUILTIN_GENERATORS", "SEED_STRIDE", "ReasoningGymTask"]

log = structlog.get_logger(__name__)

SEED_STRIDE = 1_000_003
AnswerKind = Literal["number", "countdown", "text"]

# name → (answer kind, description)
BUILTIN_GENERATORS: dict[str, tuple[AnswerKind, str]] = {
    "basic_arithmetic": ("number", "Evaluate an arithmetic expression with + - * / and brackets (reasoning-gym basic_arithmetic)."),
    "chain_sum": ("number", "Add and subtract a chain of integers (reasoning-gym chain_sum)."),
    "gsm_symbolic": ("number", "GSM8K-style grade-school word problems with a numeric answer (reasoning-gym gsm_symbolic)."),
    "countdown": ("countdown", "Reach a target number with + - * / using each given number exactly once (reasoning-gym countdown)."),
}

_FORMAT = {
    "number": "\n\nGive the final answer as a single number in answer tags, for example <answer>42</answer>.",
    "countdown": ("\n\nGive the final arithmetic expression (and nothing else) in answer tags, for example <answer>(12 + 3) * 4 - 7</answer>."),
    "text": "\n\nGive the final answer in answer tags: <answer>your answer</answer>.",
}
_COUNTDOWN_CHARS_RE = re.compile(r"^[\d\s+\-*/()]+$")
_COUNTDOWN_MAX_CHARS = 200


def _import_reasoning_gym() -> Any:
    import reasoning_gym  # imported lazily: about 2 s, and the registry should list tasks without it

    return reasoning_gym


class ReasoningGymTask(TaskBase):
    """One reasoning-gym generator as a single-answer task."""

    def __init__(
        self,
        dataset: str,
        *,
        name: str | None = None,
        answer_kind: AnswerKind | None = None,
        partial_credit: bool = False,
        description: str | None = None,
        **config: Any,
    ) -> None:
        builtin_kind, builtin_desc = BUILTIN_GENERATORS.get(dataset, ("text", f"reasoning-gym generator {dataset!r}."))
        self.dataset = dataset
        self.name = name or dataset
        self.answer_kind: AnswerKind = answer_kind or builtin_kind
        if self.answer_kind not in _FORMAT:
            raise ValueError(f"answer_kind must be one of {sorted(_FORMAT)}, got {self.answer_kind!r}")
        self.description = description or builtin_desc
        self.tools = ()
        self.partial_credit = bool(partial_credit)
        for reserved in ("size", "seed"):
            if reserved in config:
                raise ValueError(f"{self.name}: {reserved!r} is chosen by problems(n, seed), not by the task options")
        self.config = dict(config)
        rg = _import_reasoning_gym()
        try:
            self._scorer = rg.create_dataset(dataset, size=1, seed=0, **self.config)  # validates the name and the config
        except (TypeError, ValueError, AssertionError) as exc:
            raise ValueError(f"{self.name}: bad reasoning-gym config {self.config!r}: {exc}") from exc

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        self._check_n(n)
        if n == 0:
            return []
        rg = _import_reasoning_gym()
        ds = rg.create_dataset(self.dataset, size=n, seed=seed * SEED_STRIDE, **self.config)
        out = []
        for i in range(n):
            entry = ds[i]
            out.append(
                Problem(
                    task=self.name,
                    id=f"{self.name}/s{seed}/{i}",
                    prompt=str(entry["question"]).rstrip() + _FORMAT[self.answer_kind],
                    answer=entry.get("answer"),
                    metadata={"seed": seed, "index": i, "question": entry["question"], "source": entry.get("metadata", {})},
                )
            )
        log.debug("tasks.problems", task=self.name, n=n, seed=seed)
        return out

    def signature(self, problem: Problem) -> str | None:
        """The item's structure parameters from the generator's metadata (module docstring), or None."""
        src = problem.metadata.get("source", {})
        parts = [f"{k}={src[k]}" for k in ("num_terms", "num_digits") if isinstance(src.get(k), int)]
        if isinstance(src.get("numbers"), list):
            parts.append(f"numbers={len(src['numbers'])}")
        return ",".join(parts) or None

    def _entry(self, problem: Problem) -> dict[str, Any]:
        return {
            "question": problem.metadata.get("question", problem.prompt),
            "answer": problem.answer,
            "metadata": problem.metadata.get("source", {}),
        }

    def _score(self, candidate: str | None, problem: Problem) -> float:
        try:
            score = float(self._scorer.score_answer(candidate, self._entry(problem)))
        except Exception as exc:  # a third-party scorer: a crash on odd input is a zero, not an error of ours
            log.warning("tasks.scorer_error", task=self.name, problem=problem.id, error=repr(exc))
            return 0.0
        return min(1.0, max(0.0, score)) if score == score else 0.0

    def _verdict(self, score: float, detail: str, feedback: str | None = None) -> Verdict:
        """``feedback``: what the solver may see when ``detail`` names the gold answer (else ``detail`` is shown)."""
        correct = score >= 1.0
        reward = score if self.partial_credit else (1.0 if correct else 0.0)
        return Verdict(reward, correct, detail, feedback=detail if feedback is None else feedback)

    def verify(self, problem: Problem, answer: str) -> Verdict:
        if not isinstance(answer, str) or not answer.strip():
            return Verdict(0.0, False, "empty answer").shown()
        if self.answer_kind == "number":
            return self._verify_number(problem, answer)
        if self.answer_kind == "countdown":
            return self._verify_countdown(problem, answer)
        candidate = extract_answer(answer)
        if candidate is None:
            candidate = answer.strip()
        score = self._score(candidate, problem)
        gold = "" if problem.answer is None else f"expected {str(problem.answer)[:80]!r}, "
        return self._verdict(score, f"{gold}got {candidate[:80]!r} (score {score:.2f})", f"got {candidate[:80]!r}")

    def _verify_number(self, problem: Problem, answer: str) -> Verdict:
        value = extract_number(answer)
        if value is None:
            return Verdict(0.0, False, "no numeric answer found").shown()
        candidate = canonical_number(value)
        if value.denominator != 1:  # the scorers read decimals, not "p/q"
            try:
                candidate = repr(float(value))
            except OverflowError:
                return Verdict(0.0, False, "answer out of range").shown()
        score = self._score(candidate, problem)
        gold = parse_number(str(problem.answer)) if problem.answer is not None else None
        shown_gold = canonical_number(gold) if gold is not None else str(problem.answer)
        if score >= 1.0:
            return self._verdict(score, f"correct: {candidate}")
        return self._verdict(score, f"expected {shown_gold}, got {candidate}", f"{candidate} is not correct")

    def _countdown_expression(self, answer: str) -> str | None:
        candidate = extract_answer(answer)
        if candidate is None:
            stripped = answer.strip().strip("`").strip()
            lines = [ln.strip() for ln in stripped.splitlines() if ln.strip()]
            candidate = lines[-1] if lines else None
        if candidate is None:
            return None
        candidate = candidate.strip().strip("`$").strip()
        if "=" in candidate:
            candidate = candidate.split("=")[0].strip()
        candidate = candidate.replace("×", "*").replace("÷", "/").replace("−", "-")
        return candidate or None

    def _verify_countdown(self, problem: Problem, answer: str) -> Verdict:
        expr = self._countdown_expression(answer)
        if expr is None:
            return Verdict(0.0, False, "no expression found").shown()
        if len(expr) > _COUNTDOWN_MAX_CHARS or not _COUNTDOWN_CHARS_RE.match(expr) or "**" in expr or "//" in expr:
            return Verdict(0.0, False, f"not a plain + - * / expression: {expr[:60]!r}").shown()
        source = problem.metadata.get("source", {})
        target, numbers = source.get("target"), sorted(source.get("numbers", []))
        used = sorted(int(m) for m in re.findall(r"\d+", expr))
        score = self._score(expr, problem)
        if score >= 1.0:
            return self._verdict(score, f"correct: {expr} = {target}")
        if used != numbers:
            return self._verdict(score, f"uses {used}, must use each of {numbers} exactly once")
        try:
            value = evaluate(expr)
            shown = canonical_number(value)
        except ArithError as exc:
            shown = f"an error ({exc})"
        return self._verdict(score, f"{expr} evaluates to {shown}, target {target}")
