"""Testbeds for memory methods: repeated games against scripted opponents with exploitable habits.

A testbed builds a :class:`Match` (one player against one scripted opponent, seeded). The player is
driven one decision at a time, as text::

    match = rps.make_match("cycle", seed=0)
    while (prompt := match.decision_prompt()) is not None:   # the round's next decision, None when it is over
        match.act(model_reply)                               # the reply is parsed leniently into a move
    result = match.end_round()                               # payoff of the round, transcript line

Testbeds: ``rps`` (rock-paper-scissors, one decision per round) and ``holdem`` (limit Texas hold'em
with pokerkit, several decisions per hand; importable only with the ``memory`` extra installed).
``memory.testbeds.play`` runs a match through a loopwise server with a memory method.

Not here: model calls, memory methods (``memory.methods``), ratings (``experiments.memory_tournament``).
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
    reply_schema: dict[str, Any]  # JSON schema of a legal reply (for constrained decoding)

    def decision_prompt(self) -> str | None:
        """The next decision of the current round as a user message; None once the round is decided."""
        ...

    def act(self, reply: str) -> None:
        """Apply the player's reply to the pending decision."""
        ...

    def end_round(self) -> RoundResult:
        """Close the decided round and start the next one."""
        ...


TESTBEDS = ("rps", "holdem")


def opponents(testbed: str) -> tuple[str, ...]:
    """The scripted opponents of a testbed."""
    if testbed == "rps":
        from memory.testbeds.rps import OPPONENTS

        return OPPONENTS
    if testbed == "holdem":
        from memory.testbeds.holdem import OPPONENTS as HOLDEM_OPPONENTS

        return HOLDEM_OPPONENTS
    raise ValueError(f"unknown testbed {testbed!r}; known: {', '.join(TESTBEDS)}")


def actions(testbed: str) -> tuple[str, ...]:
    """Every action a player of ``testbed`` can take (what a structured memory may recommend)."""
    if testbed == "rps":
        from memory.testbeds.rps import MOVES

        return MOVES
    if testbed == "holdem":
        from memory.testbeds.holdem import ACTIONS

        return ACTIONS
    raise ValueError(f"unknown testbed {testbed!r}; known: {', '.join(TESTBEDS)}")


def make_match(testbed: str, opponent: str, seed: int, **options: object) -> Match:
    """A fresh match of ``testbed`` against ``opponent`` (see each testbed's ``make_match`` for options)."""
    if testbed == "rps":
        from memory.testbeds import rps

        return rps.make_match(opponent, seed, **options)  # type: ignore[arg-type]
    if testbed == "holdem":
        from memory.testbeds import holdem

        return holdem.make_match(opponent, seed, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown testbed {testbed!r}; known: {', '.join(TESTBEDS)}")
