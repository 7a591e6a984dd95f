"""Stop policies for the agent loop: pure functions of the turn history (SVR, SVR-R1: ``docs/methods.md``).

After every model turn the loop calls ``policy.decide(history, max_turns)`` with all turns so far (the
latest last) and gets a ``StopDecision``: stop with an answer, or continue, optionally with a feedback
message to append as the next user turn. Policies never call the model, a verifier or a tool; they only
parse the text the model wrote, so they are table-testable.

Formats (exact; see ``parse_svr`` / ``parse_svr_r1`` for every rule)::

    svr     [<think>…</think>] <solution>…</solution> <verdict>Correct|Incorrect</verdict> <confidence>0.85</confidence>
    svr_r1  [<think>…</think>] <answer>…</answer> <verify>Yes|No</verify>
    plain   … <answer>…</answer>   (only used for answer extraction; never a format failure)

Policies (``make_stop_policy(name, **params)``):

* ``fixed``  — run to ``max_turns``; the answer is the last turn's. With ``fmt="svr"``/``"svr_r1"`` it asks
  for that format and gives the same feedback as the adaptive policies, so "SVR vs fixed horizon"
  differs only in the stop rule.
* ``svr``    — stop when verdict is Correct and confidence ≥ τ; else refine with feedback built from the
  model's own verdict; at the cap return the best self-rated answer.
* ``svr_r1`` — Yes stops; a non-Yes answer turn gets a rethink while the run has fewer than ``cap``
  answer turns (default 2: one second chance); the answer turn at the cap is final whatever it says.

Turns with ``tool_calls > 0`` are action turns: the loop runs the tools and the observation is the next
user turn, so every policy answers ``continue`` (reason ``tool_call``, no feedback) for them and never
parses them; they still count towards ``max_turns``. ``decide`` assumes the loop stopped whenever a
previous decision said stop.

Not here: running the model or tools, verifiers and rewards (``agents/tasks``), the training-time reward
shaping of §5/§7 (the learner), T²PO (``agents/t2po.py``), prompt wording (``agents/prompts.py``).
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from agents import prompts
from agents.prompts import AnswerFormat

Verdict = Literal["correct", "incorrect"]

StopReason = Literal[
    "verified",  # stop: the self-check passed (svr: Correct and confidence ≥ τ; svr_r1: Yes)
    "final_answer",  # stop: svr_r1, the answer turn at its cap (the last rethink's reply)
    "max_turns",  # stop: the cap; the answer is the last answer turn's
    "max_turns_best",  # stop: svr at the cap; the answer is the best self-rated one
    "continue",  # continue: fixed policy below the cap
    "continue_refine",  # continue: svr, not verified; feedback built from the model's own verdict
    "rethink",  # continue: svr_r1, another chance after a No (below its cap)
    "format_failure",  # continue: the turn was unparsable; feedback restates the format
    "tool_call",  # continue: the turn called tools; the tool results are the next observation
]
STOP_REASONS: tuple[str, ...] = (
    "verified",
    "final_answer",
    "max_turns",
    "max_turns_best",
    "continue",
    "continue_refine",
    "rethink",
    "format_failure",
    "tool_call",
)


@dataclass(frozen=True)
class TurnView:
    """What a stop policy sees of one model turn: the output text (as decoded, think span included)."""

    text: str
    tool_calls: int = 0  # > 0: an action turn (tools run next); never parsed for a self-check


@dataclass(frozen=True)
class SelfCheck:
    """One parsed self-check. Fields that parsed are filled even when ``format_ok`` is False; policies
    only trust a check with ``format_ok``. ``error`` lists every problem found, ``; ``-separated."""

    solution: str | None
    verdict: Verdict | None
    confidence: float | None  # svr only; None for svr_r1
    format_ok: bool
    error: str | None

    @property
    def p_correct(self) -> float | None:
        """The model's stated probability that ``solution`` is right (§5: conf if Correct else 1 − conf).

        svr_r1 has no confidence: Yes → 1.0, No → 0.0. None when the check did not parse."""
        if not self.format_ok or self.verdict is None:
            return None
        if self.confidence is None:
            return 1.0 if self.verdict == "correct" else 0.0
        return self.confidence if self.verdict == "correct" else 1.0 - self.confidence


@dataclass(frozen=True)
class StopDecision:
    stop: bool
    reason: StopReason
    answer: str | None  # the final answer when stop, else None
    feedback: str | None  # the next user message the policy asks for when continuing (None: nothing to add)
    format_failure: bool  # the latest turn was unparsable in the policy's format
    best_turn: int | None  # when stop: 0-based index of the turn the answer came from
    check: SelfCheck | None = None  # the latest turn's parsed self-check (None: plain format or a tool turn)
    p_correct: float | None = None  # when stop: the stated P(correct) of the returned answer, for calibration


# ── Parsing ────────────────────────────────────────────────────────────────────────────────────────────

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CONF_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(%?)")
_MAX_SHOWN = 40  # characters of a bad value quoted back in an error message


def _shown(value: str) -> str:
    v = value.strip()
    return repr(v if len(v) <= _MAX_SHOWN else v[:_MAX_SHOWN] + "…")


def split_think(text: str) -> tuple[str, str | None]:
    """Return ``(body, error)``: the text after the last ``</think>`` (the whole text when there is none).

    A ``</think>`` without an opening tag is fine (the prompt may have opened the span). A ``<think>``
    left open in the body is an error: everything after it is still thinking."""
    cut = text.rfind(_THINK_CLOSE)
    body = text if cut < 0 else text[cut + len(_THINK_CLOSE) :]
    if _THINK_OPEN in body:
        return body, "unclosed <think>"
    return body, None


def _element(body: str, tag: str) -> tuple[tuple[int, int] | None, str | None, str | None]:
    """Exactly one ``<tag>…</tag>`` in ``body``: ``(span, content, error)``."""
    opens, closes = body.count(f"<{tag}>"), body.count(f"</{tag}>")
    if opens == 0 and closes == 0:
        return None, None, f"missing <{tag}>"
    if opens != closes:
        return None, None, f"unclosed <{tag}>" if opens > closes else f"stray </{tag}>"
    if opens > 1:
        return None, None, f"more than one <{tag}>"
    m = re.search(rf"<{tag}>(.*?)</{tag}>", body, re.S)
    if m is None:  # the closing tag comes before the opening one
        return None, None, f"malformed <{tag}>"
    return m.span(), m.group(1), None


def _elements(body: str, tags: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    found: dict[str, str] = {}
    spans: list[tuple[int, int, str]] = []
    errors: list[str] = []
    for tag in tags:
        span, content, err = _element(body, tag)
        if err is not None:
            errors.append(err)
        elif span is not None and content is not None:
            found[tag] = content
            spans.append((*span, tag))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            errors.append(f"<{b}> is inside <{a}>")
            found.pop(a, None)
            found.pop(b, None)
    return found, errors


def parse_confidence(value: str) -> tuple[float | None, str | None]:
    """A confidence is a decimal in [0, 1] (``0.85``, ``1``, ``.5``) or a percentage in [0, 100] (``85%``).

    Out of range (``1.5``, ``85`` without ``%``, ``120%``) and anything else (``high``, ``-0.1``, ``1e-1``)
    are errors, not clamped: ``1.5`` might mean 1.5 % or a 1–5 scale, and guessing would corrupt calibration."""
    m = _CONF_RE.fullmatch(value.strip())
    if m is None:
        return None, f"confidence must be a number from 0 to 1, got {_shown(value)}"
    x = float(m.group(1))
    if m.group(2):
        if x > 100:
            return None, f"confidence {_shown(value)} is above 100%"
        return x / 100.0, None
    if x > 1:
        return None, f"confidence {_shown(value)} is outside [0, 1]"
    return x, None


def parse_svr(text: str) -> SelfCheck:
    """Parse one SVR turn. Never raises. The rules:

    * An optional think span comes first; only the text after the last ``</think>`` is parsed (tags
      drafted while thinking are ignored). An unclosed ``<think>`` is a failure.
    * Exactly one each of ``<solution>``, ``<verdict>``, ``<confidence>``, in any order, not nested.
      Tag names are exact and lowercase (``<Verdict>`` is not a tag); text outside the tags is ignored.
    * solution: non-empty after stripping; returned stripped.
    * verdict: ``Correct`` or ``Incorrect``, case-insensitive, surrounding whitespace ignored.
    * confidence: see ``parse_confidence`` (``85%`` → 0.85; ``1.5`` and ``85`` are failures).
    """
    body, think_err = split_think(text)
    errors = [think_err] if think_err else []
    found, tag_errors = _elements(body, ("solution", "verdict", "confidence"))
    errors += tag_errors

    solution: str | None = None
    if "solution" in found:
        solution = found["solution"].strip() or None
        if solution is None:
            errors.append("empty <solution>")
    verdict: Verdict | None = None
    if "verdict" in found:
        v = found["verdict"].strip().lower()
        if v in ("correct", "incorrect"):
            verdict = "correct" if v == "correct" else "incorrect"
        else:
            errors.append(f"verdict must be Correct or Incorrect, got {_shown(found['verdict'])}")
    confidence: float | None = None
    if "confidence" in found:
        confidence, conf_err = parse_confidence(found["confidence"])
        if conf_err:
            errors.append(conf_err)
    return SelfCheck(solution, verdict, confidence, not errors, "; ".join(errors) or None)


def parse_svr_r1(text: str) -> SelfCheck:
    """Parse one SVR-R1 turn: ``<answer>…</answer>`` and ``<verify>Yes|No</verify>``. Never raises.

    Same rules as ``parse_svr`` (think span, exactly one of each, exact lowercase tag names, value case
    and whitespace ignored). Yes maps to verdict ``correct``, No to ``incorrect``; confidence is None."""
    body, think_err = split_think(text)
    errors = [think_err] if think_err else []
    found, tag_errors = _elements(body, ("answer", "verify"))
    errors += tag_errors

    answer: str | None = None
    if "answer" in found:
        answer = found["answer"].strip() or None
        if answer is None:
            errors.append("empty <answer>")
    verdict: Verdict | None = None
    if "verify" in found:
        v = found["verify"].strip().lower()
        if v in ("yes", "no"):
            verdict = "correct" if v == "yes" else "incorrect"
        else:
            errors.append(f"verify must be Yes or No, got {_shown(found['verify'])}")
    return SelfCheck(answer, verdict, None, not errors, "; ".join(errors) or None)


_ANSWER_RE = re.compile(r"<(answer|solution)>(.*?)</\1>", re.S)


def extract_final_answer(text: str) -> str:
    """The answer of a turn in no particular format: the content of the last complete ``<answer>`` or
    ``<solution>`` element after the think span, else that text stripped. When everything is inside
    an unclosed think span, the whole text stripped."""
    body, _ = split_think(text)
    matches = list(_ANSWER_RE.finditer(body))
    last = matches[-1] if matches else None
    if last is not None and last.group(2).strip():
        return last.group(2).strip()
    return body.strip() or text.strip()


_PARSERS = {"svr": parse_svr, "svr_r1": parse_svr_r1}


def parse_turn(text: str, fmt: AnswerFormat) -> SelfCheck | None:
    """Parse ``text`` in ``fmt``; None for ``plain`` (nothing to check)."""
    parser = _PARSERS.get(fmt)
    return parser(text) if parser else None


# ── Policies ───────────────────────────────────────────────────────────────────────────────────────────


class StopPolicy(Protocol):
    name: str
    fmt: AnswerFormat  # the answer format the policy parses
    instructions: str  # the system-prompt addition that teaches that format

    def decide(self, history: Sequence[TurnView], max_turns: int) -> StopDecision: ...


def _check_args(history: Sequence[TurnView], max_turns: int) -> None:
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not history:
        raise ValueError("decide() needs the turn that just finished; history is empty")


def _tool_continue() -> StopDecision:
    return StopDecision(stop=False, reason="tool_call", answer=None, feedback=None, format_failure=False, best_turn=None)


def _answer_of(turn: TurnView, check: SelfCheck | None) -> str:
    if check is not None and check.format_ok and check.solution is not None:
        return check.solution
    return extract_final_answer(turn.text)


def _last_answer_turn(history: Sequence[TurnView]) -> int:
    """Index of the last turn that is not a tool turn; the last turn when all are tool turns."""
    for i in range(len(history) - 1, -1, -1):
        if not history[i].tool_calls:
            return i
    return len(history) - 1


class FixedPolicy:
    """``fixed``: run to ``max_turns``; the answer is the last answer turn's (its parsed solution when it
    parses in ``fmt``, else ``extract_final_answer``). Between turns it asks for a refinement: with
    ``fmt="svr"`` the same feedback ``SVRPolicy`` would give, with ``svr_r1`` a rethink after No."""

    name = "fixed"

    def __init__(self, fmt: AnswerFormat = "plain", tau: float = 0.7, think: bool = False) -> None:
        if fmt not in prompts.ANSWER_FORMATS:
            raise ValueError(f"unknown answer format {fmt!r}; known: {', '.join(prompts.ANSWER_FORMATS)}")
        _check_tau(tau)
        self.fmt: AnswerFormat = fmt
        self.tau = tau  # only shapes the svr feedback wording
        self.instructions = prompts.format_instructions(fmt, think=think)

    def decide(self, history: Sequence[TurnView], max_turns: int) -> StopDecision:
        _check_args(history, max_turns)
        turn = history[-1]
        check = None if turn.tool_calls else parse_turn(turn.text, self.fmt)
        failed = check is not None and not check.format_ok
        if len(history) >= max_turns:
            i = _last_answer_turn(history)
            last_check = check if i == len(history) - 1 else parse_turn(history[i].text, self.fmt)
            p = last_check.p_correct if last_check is not None else None
            return StopDecision(True, "max_turns", _answer_of(history[i], last_check), None, failed, i, check, p)
        if turn.tool_calls:
            return _tool_continue()
        if check is None:
            return StopDecision(False, "continue", None, prompts.PLAIN_REFINE, False, None)
        if failed:
            return StopDecision(False, "format_failure", None, prompts.format_failure_feedback(self.fmt, check.error), True, None, check)
        if self.fmt == "svr":
            assert check.verdict is not None and check.confidence is not None
            feedback = prompts.svr_refine_feedback(check.verdict, check.confidence, self.tau)
        else:
            feedback = prompts.SVR_R1_RETHINK if check.verdict == "incorrect" else prompts.SVR_R1_RECHECK
        return StopDecision(False, "continue", None, feedback, False, None, check)


def _check_tau(tau: float) -> None:
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")


class SVRPolicy:
    """``svr`` (``docs/methods.md``, inference): stop when verdict == Correct and confidence ≥ ``tau``.

    Otherwise continue with ``continue_refine`` feedback built from the model's own verdict and
    confidence, or ``format_failure`` feedback restating the format (format failures count as turns).
    At the cap, the best self-rated answer (``max_turns_best``): the highest-confidence Correct turn;
    if no turn said Correct, the Incorrect turn with the lowest confidence (highest stated P(correct) =
    1 − confidence; the highest-confidence Incorrect is the one the model is surest is wrong). Ties go
    to the later turn (it is a refinement). No parsable turn: the last answer turn's extracted text
    (``max_turns``).

    ≥ τ, not > τ: the issue's wording; §5's pseudo-code writes ``>``; with τ = 0.7 only a stated 0.7 differs.
    """

    name = "svr"
    fmt: AnswerFormat = "svr"

    def __init__(self, tau: float = 0.7, think: bool = False) -> None:
        _check_tau(tau)
        self.tau = tau
        self.instructions = prompts.format_instructions("svr", think=think)

    def decide(self, history: Sequence[TurnView], max_turns: int) -> StopDecision:
        _check_args(history, max_turns)
        turn = history[-1]
        last = len(history) - 1
        at_cap = len(history) >= max_turns
        check = None if turn.tool_calls else parse_svr(turn.text)
        if check is not None and check.format_ok and check.verdict == "correct" and check.confidence is not None and check.confidence >= self.tau:
            return StopDecision(True, "verified", check.solution, None, False, last, check, check.p_correct)
        failed = check is not None and not check.format_ok
        if not at_cap:
            if check is None:
                return _tool_continue()
            if failed:
                return StopDecision(False, "format_failure", None, prompts.format_failure_feedback("svr", check.error), True, None, check)
            assert check.verdict is not None and check.confidence is not None
            return StopDecision(
                False, "continue_refine", None, prompts.svr_refine_feedback(check.verdict, check.confidence, self.tau), False, None, check
            )
        best = self._best(history)
        if best is None:
            i = _last_answer_turn(history)
            return StopDecision(True, "max_turns", extract_final_answer(history[i].text), None, failed, i, check)
        i, best_check = best
        return StopDecision(True, "max_turns_best", best_check.solution, None, failed, i, check, best_check.p_correct)

    @staticmethod
    def _best(history: Sequence[TurnView]) -> tuple[int, SelfCheck] | None:
        best: tuple[tuple[int, float], int, SelfCheck] | None = None
        for i, turn in enumerate(history):
            if turn.tool_calls:
                continue
            c = parse_svr(turn.text)
            if not c.format_ok or c.p_correct is None:
                continue
            key = (1 if c.verdict == "correct" else 0, c.p_correct)
            if best is None or key >= best[0]:  # >=: ties go to the later turn
                best = (key, i, c)
        return None if best is None else (best[1], best[2])


class SVRR1Policy:
    """``svr_r1`` (``docs/methods.md``; after VL-Rethinker's forced rethinking): a binary self-check; a No
    buys a rethink until the run has ``cap`` answer turns.

    Over answer turns (tool turns are skipped for ``cap`` and only count towards ``max_turns``):

    * the latest answer turn says Yes (and parses) → stop, ``verified``, its answer;
    * it did not say Yes and is answer turn k < ``cap`` → continue: No gets the rethink message
      (``rethink``); an unparsable turn gets the format restated (``format_failure``);
    * it is answer turn ``cap`` → stop, ``final_answer``, its answer whatever its verdict; if it did not
      parse, the text extracted from it (``format_failure=True``);
    * ``max_turns`` comes first → stop, ``max_turns``, the last answer turn's answer.

    ``cap`` = 2 (the default) is the "second chance" reading: one rethink. A larger ``cap`` allows
    ``cap`` − 1 rethinks, still bounded by the loop's ``max_turns``.
    """

    name = "svr_r1"
    fmt: AnswerFormat = "svr_r1"

    def __init__(self, cap: int = 2, think: bool = False) -> None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"cap (most answer turns) must be an integer >= 1, got {cap!r}")
        self.cap = cap
        self.instructions = prompts.format_instructions("svr_r1", think=think)

    def decide(self, history: Sequence[TurnView], max_turns: int) -> StopDecision:
        _check_args(history, max_turns)
        turn = history[-1]
        last = len(history) - 1
        at_cap = len(history) >= max_turns
        if turn.tool_calls:
            if not at_cap:
                return _tool_continue()
            i = _last_answer_turn(history)
            c = None if history[i].tool_calls else parse_svr_r1(history[i].text)
            return StopDecision(True, "max_turns", _answer_of(history[i], c), None, False, i, None, c.p_correct if c else None)
        check = parse_svr_r1(turn.text)
        failed = not check.format_ok
        if not failed and check.verdict == "correct":
            return StopDecision(True, "verified", check.solution, None, False, last, check, check.p_correct)
        n_answer_turns = sum(1 for t in history if not t.tool_calls)
        if n_answer_turns >= self.cap or at_cap:
            reason: StopReason = "final_answer" if n_answer_turns >= self.cap else "max_turns"
            return StopDecision(True, reason, _answer_of(turn, check), None, failed, last, check, check.p_correct)
        if failed:
            return StopDecision(False, "format_failure", None, prompts.format_failure_feedback("svr_r1", check.error), True, None, check)
        return StopDecision(False, "rethink", None, prompts.SVR_R1_RETHINK, False, None, check)


_POLICIES: dict[str, type[FixedPolicy] | type[SVRPolicy] | type[SVRR1Policy]] = {
    "fixed": FixedPolicy,
    "svr": SVRPolicy,
    "svr_r1": SVRR1Policy,
}
STOP_POLICIES: tuple[str, ...] = tuple(_POLICIES)


def make_stop_policy(name: str, **params: object) -> StopPolicy:
    """Build a policy by name (``fixed``, ``svr``, ``svr_r1``); unknown names and parameters are ValueErrors."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown stop policy {name!r}; known: {', '.join(STOP_POLICIES)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"stop policy {name!r} does not take {', '.join(unknown)}; it takes: {', '.join(accepted) or 'no parameters'}")
    return cls(**params)  # type: ignore[arg-type]
