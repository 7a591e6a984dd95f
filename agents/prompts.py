"""Prompt text for the self-verifying answer formats (SVR, SVR-R1, plain) and the stop policies' feedback.

Everything here is a constant or a small pure function returning a string, so the agent loop can add the
format instructions to an agent's system prompt and append a policy's feedback as the next user turn.
The wording is short, concrete and example-led on purpose: SmolLM2-135M must be able to follow it.

The formats themselves (what ``agents.stop.parse_svr`` / ``parse_svr_r1`` accept) are defined in
``agents/stop.py``; this module only says them in words.

Not here: parsing, deciding when to stop, the T²PO intervention text (``agents/t2po.py``), task prompts
(``agents/tasks/``), chat templating (``runtime/``).
"""

from __future__ import annotations

from typing import Literal

AnswerFormat = Literal["plain", "svr", "svr_r1"]
ANSWER_FORMATS: tuple[AnswerFormat, ...] = ("plain", "svr", "svr_r1")

# ── The format skeletons, restated in instructions and in format-failure feedback ──────────────────────

SVR_SKELETON = (
    "<solution>your solution, ending with the final answer</solution>\n"
    "<verdict>Correct or Incorrect</verdict>\n"
    "<confidence>a number from 0 to 1</confidence>"
)
SVR_R1_SKELETON = "<answer>your final answer</answer>\n<verify>Yes or No</verify>"
PLAIN_SKELETON = "<answer>your final answer</answer>"

_SKELETONS: dict[AnswerFormat, str] = {"plain": PLAIN_SKELETON, "svr": SVR_SKELETON, "svr_r1": SVR_R1_SKELETON}

# ── System-prompt additions ────────────────────────────────────────────────────────────────────────────

SVR_INSTRUCTIONS = f"""Answer in exactly this format:
{SVR_SKELETON}
First solve the problem. Then check your solution: write Correct if it is right or Incorrect if it is wrong,
and how sure you are as a number from 0 to 1.
Example:
<solution>Apples: 3 boxes of 5 is 3 * 5 = 15. The answer is 15.</solution>
<verdict>Correct</verdict>
<confidence>0.9</confidence>"""

SVR_R1_INSTRUCTIONS = f"""Answer in exactly this format:
{SVR_R1_SKELETON}
After your answer, check it. Write Yes if it is right, No if it may be wrong.
Example:
<answer>15</answer>
<verify>Yes</verify>"""

PLAIN_INSTRUCTIONS = f"""Put your final answer in this format:
{PLAIN_SKELETON}"""

THINK_INSTRUCTIONS = "You may think step by step inside <think> </think> first, then give the format."

_INSTRUCTIONS: dict[AnswerFormat, str] = {"plain": PLAIN_INSTRUCTIONS, "svr": SVR_INSTRUCTIONS, "svr_r1": SVR_R1_INSTRUCTIONS}


def format_instructions(fmt: AnswerFormat, *, think: bool = False) -> str:
    """The system-prompt addition that teaches ``fmt``; with ``think`` the model is told it may use a think span."""
    try:
        text = _INSTRUCTIONS[fmt]
    except KeyError:
        raise ValueError(f"unknown answer format {fmt!r}; known: {', '.join(ANSWER_FORMATS)}") from None
    return f"{THINK_INSTRUCTIONS}\n{text}" if think else text


# ── Feedback messages (the next user turn) ─────────────────────────────────────────────────────────────

SVR_REFINE_INCORRECT = "You judged your solution Incorrect (confidence {confidence}). Find the mistake, fix it, and answer again in the same format."
SVR_REFINE_UNSURE = (
    "You judged your solution Correct, but your confidence is only {confidence} ({tau} is needed). "
    "Check every step again. Keep the answer if it holds, fix it if not, and answer again in the same format."
)
SVR_RECHECK_CONFIDENT = (
    "You judged your solution Correct with confidence {confidence}. Check it once more. "
    "Keep the answer if it holds, fix it if not, and answer again in the same format."
)
SVR_R1_RETHINK = "Your check says the answer may be wrong. Re-examine the problem and your reasoning, then answer again in the same format."
PLAIN_REFINE = "Check your answer again. If you find a mistake, fix it. Then give your final answer again in the same format."
SVR_R1_RECHECK = "Check your answer once more, then answer again in the same format."


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x not in (0.0, 1.0) else f"{x:.0f}"


def svr_refine_feedback(verdict: Literal["correct", "incorrect"], confidence: float, tau: float) -> str:
    """The refinement message built from the model's own verification of its last solution (a Correct at or above
    ``tau`` only gets one in a fixed-horizon run, where the adaptive agent would have stopped)."""
    if verdict == "incorrect":
        return SVR_REFINE_INCORRECT.format(confidence=_num(confidence))
    if confidence >= tau:
        return SVR_RECHECK_CONFIDENT.format(confidence=_num(confidence))
    return SVR_REFINE_UNSURE.format(confidence=_num(confidence), tau=_num(tau))


def format_failure_feedback(fmt: AnswerFormat, error: str | None) -> str:
    """Tell the model what was wrong with its reply and restate the exact format."""
    why = f" ({error})" if error else ""
    return f"Your reply did not follow the format{why}. Reply again in exactly this format:\n{_SKELETONS[fmt]}"


# ── Grammars (xgrammar EBNF) that make the self-check formats impossible to break ─────────────────────

_FORMAT_GRAMMARS: dict[AnswerFormat, str] = {
    "svr": (
        'root ::= "<solution>" text "</solution>\\n<verdict>" ("Correct" | "Incorrect") "</verdict>\\n<confidence>" conf "</confidence>"\n'
        "text ::= [^<]+\n"
        'conf ::= "0." [0-9] [0-9]? | "1.0"'
    ),
    "svr_r1": 'root ::= "<answer>" text "</answer>\\n<verify>" ("Yes" | "No") "</verify>"\ntext ::= [^<]+',
}


def format_grammar(fmt: AnswerFormat) -> str | None:
    """An EBNF grammar whose every sentence parses in ``fmt`` (None for ``plain``): constrained decoding
    keeps small models inside the tagged format, so their self-checks are always readable."""
    return _FORMAT_GRAMMARS.get(fmt)
