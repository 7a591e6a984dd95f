"""What every testbed implements: ``Match`` (one player against one scripted opponent over consecutive rounds, driven
one decision at a time as text) and ``RoundResult`` (one finished round from the player's side).

Not here: the testbeds themselves (``memory/testbeds/rps.py``, ``memory/testbeds/holdem.py``) or choosing one by name
(``memory.testbeds.make_match``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RoundResult:
    """One finished round (RPS round or hold'em hand) from the player's side."""

    index: int  # 0-based round number in the match
    payoff: float  # the player's payoff (RPS: +1 win, 0 draw, -1 loss; hold'em: chips / big blind)
    won: bool  # payoff > 0
    parsed: int  # decisions whose reply held a valid action
    decisions: int  # decisions the player made this round
    line: str  # the round as one transcript line, for the memory methods


class Match(Protocol):
    """One player against one scripted opponent over consecutive rounds."""

    testbed: str
    opponent: str
    seed: int
    rules: str  # the game's rules for the player's system prompt

    @property
    def reply_schema(self) -> dict[str, Any]:
        """JSON schema of a legal reply (for constrained decoding); it may change with the pending decision."""
        ...

    def decision_prompt(self) -> str | None:
        """The next decision of the current round as a user message; None once the round is decided."""
        ...

    def act(self, reply: str) -> None:
        """Apply the player's reply to the pending decision."""
        ...

    def end_round(self) -> RoundResult:
        """Close the decided round and start the next one."""
        ...
