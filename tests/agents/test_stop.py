"""Stop policies and self-check parsers on tables of turn histories (agents/stop.py)."""

from __future__ import annotations

import pytest

from agents import prompts
from agents.stop import (
    STOP_POLICIES,
    STOP_REASONS,
    FixedPolicy,
    SelfCheck,
    SVRPolicy,
    SVRR1Policy,
    TurnView,
    extract_final_answer,
    make_stop_policy,
    parse_confidence,
    parse_svr,
    parse_svr_r1,
    split_think,
)


def svr(solution: str, verdict: str, confidence: str | float) -> str:
    return f"<solution>{solution}</solution>\n<verdict>{verdict}</verdict>\n<confidence>{confidence}</confidence>"


def r1(answer: str, verify: str) -> str:
    return f"<answer>{answer}</answer>\n<verify>{verify}</verify>"


def turns(*texts: str) -> list[TurnView]:
    return [TurnView(t) for t in texts]


GARBAGE = "I think the answer is 7."


# ── parse_svr ──────────────────────────────────────────────────────────────────────────────────────────

PARSE_SVR_OK = [
    # (text, solution, verdict, confidence)
    (svr("42", "Correct", "0.85"), "42", "correct", 0.85),
    (svr("42", "Incorrect", "0.2"), "42", "incorrect", 0.2),
    ("  <solution>\n  x = 3 \n</solution>  <verdict>  Correct\n</verdict>\t<confidence> 0.5 </confidence>\n", "x = 3", "correct", 0.5),
    (svr("42", "correct", "1"), "42", "correct", 1.0),
    (svr("42", "INCORRECT", "0"), "42", "incorrect", 0.0),
    (svr("42", "Correct", ".75"), "42", "correct", 0.75),
    (svr("42", "Correct", "85%"), "42", "correct", 0.85),
    (svr("42", "Correct", "100 %"), "42", "correct", 1.0),
    (svr("42", "Correct", "1.0"), "42", "correct", 1.0),
    # any order, text around the tags ignored
    ("Let me see. <confidence>0.6</confidence> then <verdict>Correct</verdict> and <solution>9</solution> done.", "9", "correct", 0.6),
    # a think span first; tags drafted inside it are ignored
    ("<think>maybe <solution>8</solution><verdict>Incorrect</verdict></think>" + svr("9", "Correct", "0.9"), "9", "correct", 0.9),
    # the prompt opened the think span: a bare </think> is fine
    ("still thinking...</think>" + svr("9", "Correct", "0.9"), "9", "correct", 0.9),
    # multi-line solution with the boxed answer
    (svr("Step 1: 2+2=4.\nSo \\boxed{4}.", "Correct", "0.7"), "Step 1: 2+2=4.\nSo \\boxed{4}.", "correct", 0.7),
]


@pytest.mark.parametrize(("text", "solution", "verdict", "confidence"), PARSE_SVR_OK)
def test_parse_svr_accepts(text: str, solution: str, verdict: str, confidence: float) -> None:
    c = parse_svr(text)
    assert c.format_ok, c.error
    assert c.error is None
    assert (c.solution, c.verdict) == (solution, verdict)
    assert c.confidence == pytest.approx(confidence)


PARSE_SVR_BAD = [
    # (text, substring of the error)
    (GARBAGE, "missing <solution>"),
    ("", "missing <solution>"),
    ("<solution>42</solution><verdict>Correct</verdict>", "missing <confidence>"),
    ("<solution>42</solution><confidence>0.8</confidence>", "missing <verdict>"),
    (svr("42", "Correct", "0.8") + "<verdict>Incorrect</verdict>", "more than one <verdict>"),
    (svr("42", "Correct", "0.8") + svr("43", "Correct", "0.9"), "more than one <solution>"),
    ("<solution>42<verdict>Correct</verdict><confidence>0.8</confidence>", "unclosed <solution>"),
    ("42</solution><verdict>Correct</verdict><confidence>0.8</confidence>", "stray </solution>"),
    ("</solution>42<solution><verdict>Correct</verdict><confidence>0.8</confidence>", "malformed <solution>"),
    (svr("42", "Correct", "1.5"), "outside [0, 1]"),
    (svr("42", "Correct", "85"), "outside [0, 1]"),
    (svr("42", "Correct", "120%"), "above 100%"),
    (svr("42", "Correct", "-0.2"), "number from 0 to 1"),
    (svr("42", "Correct", "high"), "number from 0 to 1"),
    (svr("42", "Correct", ""), "number from 0 to 1"),
    (svr("42", "Yes", "0.8"), "verdict must be Correct or Incorrect"),
    (svr("42", "Probably correct", "0.8"), "verdict must be Correct or Incorrect"),
    (svr("   ", "Correct", "0.8"), "empty <solution>"),
    ("<Solution>42</Solution><Verdict>Correct</Verdict><Confidence>0.8</Confidence>", "missing <solution>"),
    ("<solution>42 <verdict>Correct</verdict></solution><confidence>0.8</confidence>", "<verdict> is inside <solution>"),
    ("<think>" + svr("42", "Correct", "0.9"), "unclosed <think>"),
    (svr("42", "Correct", "0.9") + "<think>wait", "unclosed <think>"),
]


@pytest.mark.parametrize(("text", "error"), PARSE_SVR_BAD)
def test_parse_svr_rejects(text: str, error: str) -> None:
    c = parse_svr(text)
    assert not c.format_ok
    assert c.error is not None and error in c.error
    assert c.p_correct is None


def test_parse_svr_reports_every_problem_and_keeps_what_parsed() -> None:
    c = parse_svr("<solution>42</solution><verdict>maybe</verdict><confidence>2</confidence>")
    assert not c.format_ok
    assert c.solution == "42"
    assert c.verdict is None and c.confidence is None
    assert c.error is not None and "verdict must be" in c.error and "outside [0, 1]" in c.error


def test_parse_svr_never_raises_on_odd_input() -> None:
    for text in [
        "<",
        "</think>",
        "<solution></solution>",
        "<solution>" * 3,
        "\x00\ufffd",
        "<confidence>nan</confidence>",
        "<confidence>inf</confidence>",
    ]:
        assert parse_svr(text).format_ok is False


def test_error_quotes_long_values_truncated() -> None:
    c = parse_svr(svr("42", "Correct", "x" * 500))
    assert c.error is not None and len(c.error) < 120


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.85", 0.85),
        ("0", 0.0),
        ("1", 1.0),
        ("85%", 0.85),
        ("0%", 0.0),
        (" 7.5% ", 0.075),
        ("1.5", None),
        ("85", None),
        ("1e-1", None),
        ("0.5.", None),
    ],
)
def test_parse_confidence(value: str, expected: float | None) -> None:
    got, err = parse_confidence(value)
    if expected is None:
        assert got is None and err
    else:
        assert err is None and got == pytest.approx(expected)


# ── parse_svr_r1 ───────────────────────────────────────────────────────────────────────────────────────

PARSE_R1 = [
    # (text, format_ok, answer, verdict)
    (r1("42", "Yes"), True, "42", "correct"),
    (r1("42", "No"), True, "42", "incorrect"),
    (r1(" 42 ", " yes\n"), True, "42", "correct"),
    (r1("42", "NO"), True, "42", "incorrect"),
    ("<think>hmm <verify>No</verify></think>" + r1("42", "Yes"), True, "42", "correct"),
    (r1("42", "Maybe"), False, "42", None),
    (r1("42", "Correct"), False, "42", None),
    ("<answer>42</answer>", False, "42", None),
    (r1("42", "Yes") + "<verify>No</verify>", False, "42", None),
    (r1("", "Yes"), False, None, "correct"),
    (GARBAGE, False, None, None),
]


@pytest.mark.parametrize(("text", "ok", "answer", "verdict"), PARSE_R1)
def test_parse_svr_r1(text: str, ok: bool, answer: str | None, verdict: str | None) -> None:
    c = parse_svr_r1(text)
    assert c.format_ok is ok
    assert (c.solution, c.verdict, c.confidence) == (answer, verdict, None)
    assert (c.error is None) is ok


@pytest.mark.parametrize(
    ("check", "p"),
    [
        (SelfCheck("a", "correct", 0.8, True, None), 0.8),
        (SelfCheck("a", "incorrect", 0.8, True, None), pytest.approx(0.2)),
        (SelfCheck("a", "correct", None, True, None), 1.0),
        (SelfCheck("a", "incorrect", None, True, None), 0.0),
        (SelfCheck("a", "correct", 0.8, False, "x"), None),
    ],
)
def test_p_correct(check: SelfCheck, p: float | None) -> None:
    assert check.p_correct == p


# ── extraction ─────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("The answer is 7.", "The answer is 7."),
        ("<answer>7</answer>", "7"),
        ("<answer>6</answer> no wait <answer> 7 </answer>", "7"),
        ("<answer>6</answer> then <solution>7</solution>", "7"),
        ("<think><answer>1</answer></think> <answer>2</answer>", "2"),
        ("<think>only thinking, never closed", "<think>only thinking, never closed"),
        ("<answer>  </answer>", "<answer>  </answer>"),
        ("  \n 12 \n", "12"),
    ],
)
def test_extract_final_answer(text: str, answer: str) -> None:
    assert extract_final_answer(text) == answer


def test_split_think() -> None:
    assert split_think("<think>a</think> b") == (" b", None)
    assert split_think("a</think>b</think>c") == ("c", None)
    assert split_think("<think>a") == ("<think>a", "unclosed <think>")


# ── SVR policy ─────────────────────────────────────────────────────────────────────────────────────────

OK_HI = svr("42", "Correct", "0.9")
OK_LO = svr("41", "Correct", "0.5")
BAD = svr("40", "Incorrect", "0.8")

SVR_TABLE = [
    # (id, history texts, max_turns, stop, reason, answer, best_turn, format_failure)
    ("verified on turn 1", [OK_HI], 5, True, "verified", "42", 0, False),
    ("incorrect then correct", [BAD, OK_HI], 5, True, "verified", "42", 1, False),
    ("incorrect continues", [BAD], 5, False, "continue_refine", None, None, False),
    ("correct but low confidence continues", [OK_LO], 5, False, "continue_refine", None, None, False),
    ("confidence exactly tau stops", [svr("42", "Correct", "0.7")], 5, True, "verified", "42", 0, False),
    ("just below tau continues", [svr("42", "Correct", "0.69")], 5, False, "continue_refine", None, None, False),
    ("percent confidence stops", [svr("42", "Correct", "90%")], 5, True, "verified", "42", 0, False),
    ("high-confidence Incorrect never stops", [svr("42", "Incorrect", "1")], 5, False, "continue_refine", None, None, False),
    ("format failure continues, flagged", [GARBAGE], 5, False, "format_failure", None, None, True),
    ("format failure then recovery", [GARBAGE, OK_HI], 5, True, "verified", "42", 1, False),
    ("verified on the last allowed turn", [BAD, BAD, OK_HI], 3, True, "verified", "42", 2, False),
    # at the cap: the best self-rated answer
    (
        "cap: best Correct by confidence",
        [svr("a", "Correct", "0.6"), svr("b", "Correct", "0.65"), svr("c", "Incorrect", "0.9")],
        3,
        True,
        "max_turns_best",
        "b",
        1,
        False,
    ),
    ("cap: Correct beats any Incorrect", [svr("a", "Incorrect", "0.01"), svr("b", "Correct", "0.3")], 2, True, "max_turns_best", "b", 1, False),
    ("cap: ties go to the later turn", [svr("a", "Correct", "0.6"), svr("b", "Correct", "0.6")], 2, True, "max_turns_best", "b", 1, False),
    (
        "cap: all Incorrect → least sure it is wrong",
        [svr("a", "Incorrect", "0.9"), svr("b", "Incorrect", "0.4"), svr("c", "Incorrect", "0.6")],
        3,
        True,
        "max_turns_best",
        "b",
        1,
        False,
    ),
    ("cap: unparsable last turn, best earlier", [OK_LO, GARBAGE], 2, True, "max_turns_best", "41", 0, True),
    ("cap: all unparsable → last text", [GARBAGE, "<answer>7</answer> whatever"], 2, True, "max_turns", "7", 1, True),
    ("cap: all unparsable, no tags → whole text", ["nope", GARBAGE], 2, True, "max_turns", GARBAGE, 1, True),
    ("cap of 1", [OK_LO], 1, True, "max_turns_best", "41", 0, False),
    ("over the cap still stops", [BAD, BAD, BAD], 2, True, "max_turns_best", "40", 2, False),
]


@pytest.mark.parametrize(
    ("history", "max_turns", "stop", "reason", "answer", "best_turn", "format_failure"), [t[1:] for t in SVR_TABLE], ids=[t[0] for t in SVR_TABLE]
)
def test_svr_policy(
    history: list[str], max_turns: int, stop: bool, reason: str, answer: str | None, best_turn: int | None, format_failure: bool
) -> None:
    d = SVRPolicy(tau=0.7).decide(turns(*history), max_turns)
    assert (d.stop, d.reason, d.answer, d.best_turn, d.format_failure) == (stop, reason, answer, best_turn, format_failure)
    assert d.reason in STOP_REASONS
    assert (d.feedback is None) is stop  # every continue (no tool turns here) carries feedback
    assert d.check is not None and d.check.format_ok is not format_failure


def test_svr_feedback_is_built_from_the_models_own_verdict() -> None:
    policy = SVRPolicy(tau=0.8)
    incorrect = policy.decide(turns(svr("40", "Incorrect", "0.75")), 4)
    assert incorrect.feedback == prompts.svr_refine_feedback("incorrect", 0.75, 0.8)
    assert "Incorrect" in incorrect.feedback and "0.75" in incorrect.feedback
    unsure = policy.decide(turns(svr("41", "Correct", "0.6")), 4)
    assert unsure.feedback is not None and "0.6" in unsure.feedback and "0.8" in unsure.feedback
    assert unsure.feedback != incorrect.feedback


def test_svr_format_failure_feedback_restates_the_format() -> None:
    d = SVRPolicy().decide(turns(svr("42", "Correct", "1.5")), 4)
    assert d.format_failure and d.reason == "format_failure"
    assert d.feedback is not None
    assert "outside [0, 1]" in d.feedback
    for tag in ("<solution>", "<verdict>", "<confidence>"):
        assert tag in d.feedback


def test_svr_p_correct_of_the_returned_answer() -> None:
    assert SVRPolicy().decide(turns(OK_HI), 3).p_correct == pytest.approx(0.9)
    assert SVRPolicy().decide(turns(BAD, BAD), 2).p_correct == pytest.approx(0.2)
    assert SVRPolicy().decide(turns(GARBAGE), 1).p_correct is None


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0])
def test_svr_tau_bounds(tau: float) -> None:
    d = SVRPolicy(tau=tau).decide(turns(svr("x", "Correct", "1")), 3)
    assert d.stop and d.reason == "verified"


def test_svr_rejects_bad_tau() -> None:
    with pytest.raises(ValueError, match="tau"):
        SVRPolicy(tau=1.2)


def test_svr_tool_turns_continue_without_feedback_and_count_towards_the_cap() -> None:
    policy = SVRPolicy()
    tool = TurnView("<tool_call>{...}</tool_call>", tool_calls=1)
    d = policy.decide([tool], 3)
    assert (d.stop, d.reason, d.feedback, d.format_failure, d.check) == (False, "tool_call", None, False, None)
    d = policy.decide([TurnView(OK_LO), tool], 2)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "max_turns_best", "41", 0)
    d = policy.decide([TurnView(GARBAGE), tool], 2)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "max_turns", GARBAGE, 0)
    d = policy.decide([tool, TurnView(OK_HI)], 3)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "verified", "42", 1)


def test_decide_argument_errors() -> None:
    with pytest.raises(ValueError, match="history is empty"):
        SVRPolicy().decide([], 3)
    with pytest.raises(ValueError, match="max_turns"):
        SVRPolicy().decide(turns(OK_HI), 0)


def test_decide_is_pure() -> None:
    policy, history = SVRPolicy(), turns(BAD, OK_LO)
    assert policy.decide(history, 5) == policy.decide(list(history), 5)
    assert history == turns(BAD, OK_LO)


# ── SVR-R1 policy ──────────────────────────────────────────────────────────────────────────────────────

YES, NO = r1("42", "Yes"), r1("41", "No")

R1_TABLE = [
    # (id, history, max_turns, stop, reason, answer, best_turn, format_failure, feedback)
    ("yes stops", [YES], 2, True, "verified", "42", 0, False, None),
    ("no → rethink", [NO], 2, False, "rethink", None, None, False, prompts.SVR_R1_RETHINK),
    ("no → rethink → yes", [NO, YES], 2, True, "verified", "42", 1, False, None),
    ("no → rethink → no stops with the rethink's answer", [NO, r1("43", "No")], 2, True, "final_answer", "43", 1, False, None),
    ("default cap: one rethink even with more turns", [NO, r1("43", "No")], 5, True, "final_answer", "43", 1, False, None),
    ("no at a cap of 1", [NO], 1, True, "max_turns", "41", 0, False, None),
    ("format failure → one second chance", [GARBAGE], 2, False, "format_failure", None, None, True, None),
    ("format failure → rethink yes", [GARBAGE, YES], 2, True, "verified", "42", 1, False, None),
    ("no → unparsable rethink: extracted from it", [NO, "<answer>44</answer> hmm"], 2, True, "final_answer", "44", 1, True, None),
    ("no → rethink of bare text", [NO, GARBAGE], 3, True, "final_answer", GARBAGE, 1, True, None),
    ("unparsable twice", [GARBAGE, GARBAGE], 2, True, "final_answer", GARBAGE, 1, True, None),
]


@pytest.mark.parametrize(
    ("history", "max_turns", "stop", "reason", "answer", "best_turn", "format_failure", "feedback"),
    [t[1:] for t in R1_TABLE],
    ids=[t[0] for t in R1_TABLE],
)
def test_svr_r1_policy(
    history: list[str], max_turns: int, stop: bool, reason: str, answer: str | None, best_turn: int | None, format_failure: bool, feedback: str | None
) -> None:
    d = SVRR1Policy().decide(turns(*history), max_turns)
    assert (d.stop, d.reason, d.answer, d.best_turn, d.format_failure) == (stop, reason, answer, best_turn, format_failure)
    if feedback is not None:
        assert d.feedback == feedback
    assert (d.feedback is None) is stop


def test_svr_r1_cap_allows_more_rethinks() -> None:
    """``cap`` answer turns: a No below it gets another rethink; the answer turn at it is final whatever it says."""
    policy = SVRR1Policy(cap=3)
    d = policy.decide(turns(NO, r1("43", "No")), 5)
    assert (d.stop, d.reason, d.feedback) == (False, "rethink", prompts.SVR_R1_RETHINK)
    d = policy.decide(turns(NO, r1("43", "No"), YES), 5)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "verified", "42", 2)
    d = policy.decide(turns(NO, r1("43", "No"), r1("44", "No")), 5)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "final_answer", "44", 2)
    d = policy.decide(turns(NO, r1("43", "No")), 2)  # the loop's max_turns comes first
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "max_turns", "43", 1)
    d = SVRR1Policy(cap=1).decide(turns(NO), 5)  # no rethink at all
    assert (d.stop, d.reason, d.answer) == (True, "final_answer", "41")
    assert make_stop_policy("svr_r1", cap=4).cap == 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cap"):
        SVRR1Policy(cap=0)


def test_svr_r1_format_failure_feedback_restates_the_format() -> None:
    d = SVRR1Policy().decide(turns(r1("42", "Maybe")), 2)
    assert d.feedback is not None and "<answer>" in d.feedback and "<verify>" in d.feedback and "Yes or No" in d.feedback


def test_svr_r1_tool_turns_are_not_answer_turns() -> None:
    tool = TurnView("calling", tool_calls=2)
    policy = SVRR1Policy()
    assert policy.decide([TurnView(NO), tool], 4).reason == "tool_call"
    d = policy.decide([TurnView(NO), tool, TurnView(r1("43", "No"))], 4)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "final_answer", "43", 2)
    d = policy.decide([TurnView(NO), tool], 2)
    assert (d.stop, d.reason, d.answer, d.best_turn) == (True, "max_turns", "41", 0)


# ── Fixed policy ───────────────────────────────────────────────────────────────────────────────────────

FIXED_TABLE = [
    # (id, fmt, history, max_turns, stop, reason, answer, format_failure)
    ("plain continues below the cap", "plain", ["<answer>1</answer>"], 3, False, "continue", None, False),
    ("plain ignores a verified-looking turn", "plain", [OK_HI], 3, False, "continue", None, False),
    ("plain at the cap: last answer tag", "plain", ["<answer>1</answer>", "<answer>2</answer> <answer>3</answer>"], 2, True, "max_turns", "3", False),
    ("plain at the cap: last solution tag", "plain", ["x", OK_HI], 2, True, "max_turns", "42", False),
    ("plain at the cap: whole text", "plain", ["x", "  just 5  "], 2, True, "max_turns", "just 5", False),
    ("svr does not stop early", "svr", [OK_HI], 3, False, "continue", None, False),
    ("svr at the cap: the last turn, not the best", "svr", [OK_HI, OK_LO], 2, True, "max_turns", "41", False),
    ("svr format failure continues", "svr", [GARBAGE], 3, False, "format_failure", None, True),
    ("svr at the cap, last unparsable", "svr", [OK_HI, GARBAGE], 2, True, "max_turns", GARBAGE, True),
    ("svr_r1 does not stop on yes", "svr_r1", [YES], 3, False, "continue", None, False),
    ("svr_r1 at the cap", "svr_r1", [NO, YES, NO], 3, True, "max_turns", "41", False),
]


@pytest.mark.parametrize(
    ("fmt", "history", "max_turns", "stop", "reason", "answer", "format_failure"), [t[1:] for t in FIXED_TABLE], ids=[t[0] for t in FIXED_TABLE]
)
def test_fixed_policy(
    fmt: prompts.AnswerFormat, history: list[str], max_turns: int, stop: bool, reason: str, answer: str | None, format_failure: bool
) -> None:
    d = FixedPolicy(fmt=fmt).decide(turns(*history), max_turns)
    assert (d.stop, d.reason, d.answer, d.format_failure) == (stop, reason, answer, format_failure)
    assert d.best_turn == (len(history) - 1 if stop else None)
    assert (d.feedback is None) is stop


def test_fixed_feedback_matches_the_adaptive_policies() -> None:
    for text in (OK_LO, BAD, GARBAGE):
        assert FixedPolicy(fmt="svr").decide(turns(text), 5).feedback == SVRPolicy().decide(turns(text), 5).feedback
    assert FixedPolicy(fmt="svr_r1").decide(turns(NO), 5).feedback == prompts.SVR_R1_RETHINK
    assert FixedPolicy(fmt="svr_r1").decide(turns(YES), 5).feedback == prompts.SVR_R1_RECHECK
    assert FixedPolicy().decide(turns("7"), 5).feedback == prompts.PLAIN_REFINE


def test_fixed_at_the_cap_after_a_tool_turn_answers_from_the_last_answer_turn() -> None:
    d = FixedPolicy().decide([TurnView("<answer>9</answer>"), TurnView("call", tool_calls=1)], 2)
    assert (d.stop, d.answer, d.best_turn) == (True, "9", 0)


# ── Factory and prompts ────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("name", "params", "cls", "fmt"),
    [
        ("fixed", {}, FixedPolicy, "plain"),
        ("fixed", {"fmt": "svr"}, FixedPolicy, "svr"),
        ("svr", {"tau": 0.9}, SVRPolicy, "svr"),
        ("svr_r1", {}, SVRR1Policy, "svr_r1"),
    ],
)
def test_make_stop_policy(name: str, params: dict[str, object], cls: type, fmt: str) -> None:
    p = make_stop_policy(name, **params)
    assert isinstance(p, cls)
    assert p.name == name and p.fmt == fmt
    assert p.instructions == prompts.format_instructions(p.fmt)


def test_make_stop_policy_errors() -> None:
    assert STOP_POLICIES == ("fixed", "svr", "svr_r1")
    with pytest.raises(ValueError, match=r"unknown stop policy 'svrr'; known: fixed, svr, svr_r1"):
        make_stop_policy("svrr")
    with pytest.raises(ValueError, match=r"does not take threshold; it takes: tau, think"):
        make_stop_policy("svr", threshold=0.5)
    with pytest.raises(ValueError, match="unknown answer format"):
        make_stop_policy("fixed", fmt="json")
    assert make_stop_policy("svr", tau=0.9).tau == 0.9  # type: ignore[attr-defined]


def test_think_instructions() -> None:
    p = make_stop_policy("svr", think=True)
    assert "<think>" in p.instructions and p.instructions.endswith(prompts.SVR_INSTRUCTIONS)


@pytest.mark.parametrize(("fmt", "parser"), [("svr", parse_svr), ("svr_r1", parse_svr_r1)])
def test_instruction_examples_parse(fmt: prompts.AnswerFormat, parser: object) -> None:
    """The example in each format's instructions is itself a valid, verified turn."""
    text = prompts.format_instructions(fmt)
    example = text.split("Example:\n", 1)[1]
    check = parser(example)  # type: ignore[operator]
    assert check.format_ok and check.verdict == "correct"
