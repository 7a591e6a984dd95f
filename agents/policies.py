"""Stop policies by name, including ``answer`` (the usual tool-agent rule) next to ``agents.stop``'s.

``answer``: stop at the first turn without tool calls and return its final answer; at the turn cap
return the last answer turn's text. It is a pure function of the history like the others.

Not here: the self-verifying policies themselves (``agents/stop.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from agents import prompts
from agents.stop import STOP_POLICIES, StopDecision, StopPolicy, TurnView, extract_final_answer, make_stop_policy

POLICY_NAMES: tuple[str, ...] = ("answer", *STOP_POLICIES)


class AnswerPolicy:
    name = "answer"
    fmt: prompts.AnswerFormat = "plain"

    def __init__(self) -> None:
        self.instructions = prompts.format_instructions("plain")

    def decide(self, history: Sequence[TurnView], max_turns: int) -> StopDecision:
        if not history:
            raise ValueError("decide() needs the turn that just finished; history is empty")
        turn = history[-1]
        if not turn.tool_calls:
            return StopDecision(True, "final_answer", extract_final_answer(turn.text), None, False, len(history) - 1)
        if len(history) >= max_turns:
            answer_turns = [i for i, t in enumerate(history) if not t.tool_calls]
            i = answer_turns[-1] if answer_turns else len(history) - 1
            return StopDecision(True, "max_turns", extract_final_answer(history[i].text), None, False, i)
        return StopDecision(False, "tool_call", None, None, False, None)


def make_policy(name: str, **params: object) -> StopPolicy:
    """``answer`` or any of ``agents.stop.STOP_POLICIES``; unknown names and parameters are ValueErrors."""
    if name == "answer":
        if params:
            raise ValueError(f"stop policy 'answer' takes no parameters, got {', '.join(sorted(params))}")
        return AnswerPolicy()
    return make_stop_policy(name, **params)
