"""Testbeds for memory methods: repeated games against scripted opponents with exploitable habits.

A testbed builds a ``Match`` (one player against one scripted opponent, seeded: the protocol, with the
``RoundResult`` of a finished round, is ``memory/testbeds/match.py``). The player is driven one decision at a
time, as text::

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

from typing import Any

from memory.testbeds.match import Match

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


def make_match(testbed: str, opponent: str, seed: int, **options: Any) -> Match:
    """A fresh match of ``testbed`` against ``opponent`` (see each testbed's ``make_match`` for options)."""
    if testbed == "rps":
        from memory.testbeds import rps

        return rps.make_match(opponent, seed, **options)
    if testbed == "holdem":
        from memory.testbeds import holdem

        return holdem.make_match(opponent, seed, **options)
    raise ValueError(f"unknown testbed {testbed!r}; known: {', '.join(TESTBEDS)}")
