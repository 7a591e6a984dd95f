"""Multi-round rock-paper-scissors against seeded scripted opponents with exploitable habits.

Opponents (``OPPONENTS``); "beats(m)" is the move that beats ``m``, the player's move of round ``t`` is ``p_t``:

- ``cycle``: repeats a fixed cycle, one of ``CYCLES`` picked by the seed, from a seeded offset.
- ``bias``: a favourite move (seeded) with probability ``BIAS_P`` (0.7), otherwise one of the other two at random.
- ``wsls``: win-stay, lose-shift: repeats its move after a win; after a loss or a draw it plays ``beats(p_{t-1})``.
- ``copy``: plays ``p_{t-1}`` (copies the player's last move).
- ``beat-last``: plays ``beats(p_{t-1})``.
- ``mix``: a mixture: the ``copy`` habit with probability ``MIX_P`` (0.7), otherwise uniformly random.

Round 0 of the history-based opponents (``wsls``, ``copy``, ``beat-last``, ``mix``) is a seeded random
move; after a round the player forfeited they repeat their own last move. Every random draw comes
from the opponent's own ``random.Random`` seeded by (opponent, seed), so a match is reproducible
given the player's moves.

The player's move is parsed leniently from its reply (:func:`parse_move`): a reply that starts with a
move, then ``move: X``/``I play X``-style phrases, then the first move named anywhere, then a lone
``R``/``P``/``S`` letter or a hand emoji. A reply without any move is *invalid*: with ``invalid="loss"``
(default) the round is forfeited (payoff -1, the opponent's move still shown); with
``invalid="random"`` the player's move is drawn from an RNG seeded by (seed, round, reply text), so a
different reply can give a different move (useful for tiny test models that never name a move).

Payoff per round: +1 win, 0 draw, -1 loss. Not here: model calls or memory.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from memory.testbeds.match import RoundResult

MOVES = ("rock", "paper", "scissors")
BEATS = {"rock": "paper", "paper": "scissors", "scissors": "rock"}  # BEATS[m] beats m
OPPONENTS = ("cycle", "bias", "wsls", "copy", "beat-last", "mix")
CYCLES: tuple[tuple[str, ...], ...] = (
    ("rock", "paper", "scissors"),
    ("rock", "rock", "paper"),
    ("scissors", "paper"),
    ("paper", "paper", "scissors", "rock"),
)
BIAS_P = 0.7
MIX_P = 0.7

RULES = (
    "You are playing many rounds of rock-paper-scissors against the same opponent. "
    "Rock beats scissors, scissors beats paper, paper beats rock. A win scores +1, a draw 0, a loss -1. "
    "The opponent has habits that can be exploited. "
    "Answer each round with exactly one word: rock, paper or scissors."
)


def payoff(player: str, opponent: str) -> int:
    """+1 if ``player`` beats ``opponent``, 0 on a draw, -1 otherwise."""
    if player == opponent:
        return 0
    return 1 if BEATS[opponent] == player else -1


_WORD = r"(rock|paper|scissors?)"
_LEADING = re.compile(r"^[\s\W_]*" + _WORD + r"\b", re.IGNORECASE)
_PHRASE = re.compile(
    r"\b(?:move|answer|choice|play|playing|choose|pick|throw|go\s+with|select)\b\W{0,3}(?:is\s+|will\s+be\s+|:\s*)?[\W_]{0,3}" + _WORD + r"\b",
    re.IGNORECASE,
)
_ANY = re.compile(r"\b" + _WORD + r"\b", re.IGNORECASE)
_LETTER = re.compile(r"^[\s\W_]*([RPS])[\s\W_]*$", re.IGNORECASE)
_EMOJI = {"✊": "rock", "👊": "rock", "🪨": "rock", "✋": "paper", "🖐": "paper", "📄": "paper", "✌": "scissors", "✂": "scissors"}


def _norm(word: str) -> str:
    w = word.lower()
    return "scissors" if w.startswith("scissor") else w


def parse_move(text: str) -> str | None:
    """The move a reply names (see the module docstring for the order of rules), or None."""
    for pattern in (_LEADING, _PHRASE, _ANY):
        m = pattern.search(text)
        if m:
            return _norm(m.group(1))
    if m := _LETTER.match(text):
        return {"r": "rock", "p": "paper", "s": "scissors"}[m.group(1).lower()]
    for emoji, move in _EMOJI.items():
        if emoji in text:
            return move
    return None


@dataclass
class Opponent:
    """A scripted opponent: ``move(history)`` with ``history`` the past (player, opponent) moves."""

    kind: str
    seed: int
    rng: random.Random = field(init=False)
    cycle: tuple[str, ...] = field(init=False, default=())
    offset: int = field(init=False, default=0)
    favourite: str = field(init=False, default="rock")

    def __post_init__(self) -> None:
        if self.kind not in OPPONENTS:
            raise ValueError(f"unknown rps opponent {self.kind!r}; known: {', '.join(OPPONENTS)}")
        self.rng = random.Random(f"rps:{self.kind}:{self.seed}")
        self.cycle = CYCLES[self.rng.randrange(len(CYCLES))]
        self.offset = self.rng.randrange(len(self.cycle))
        self.favourite = self.rng.choice(MOVES)

    def move(self, history: list[tuple[str, str]]) -> str:
        t = len(history)
        if self.kind == "cycle":
            return self.cycle[(self.offset + t) % len(self.cycle)]
        if self.kind == "bias":
            if self.rng.random() < BIAS_P:
                return self.favourite
            return self.rng.choice([m for m in MOVES if m != self.favourite])
        if t == 0:
            return self.rng.choice(MOVES)
        last_player, last_own = history[-1]
        if last_player == "none":  # the player forfeited the last round: nothing to react to
            return last_own
        if self.kind == "wsls":
            return last_own if payoff(last_own, last_player) > 0 else BEATS[last_player]
        if self.kind == "copy":
            return last_player
        if self.kind == "beat-last":
            return BEATS[last_player]
        # mix: copy with probability MIX_P, otherwise uniform
        return last_player if self.rng.random() < MIX_P else self.rng.choice(MOVES)


_OUTCOME = {1: "you won", 0: "draw", -1: "you lost"}


@dataclass
class RPSMatch:
    """Rock-paper-scissors against one scripted opponent; one decision per round."""

    opponent: str
    seed: int
    invalid: Literal["loss", "random"] = "loss"
    testbed: str = "rps"
    rules: str = RULES
    reply_schema: dict[str, Any] = field(default_factory=lambda: {"type": "string", "enum": list(MOVES)})
    history: list[tuple[str, str]] = field(default_factory=list)  # (player move, opponent move); invalid → "none"
    _bot: Opponent = field(init=False)
    _pending: RoundResult | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.invalid not in ("loss", "random"):
            raise ValueError(f"invalid must be 'loss' or 'random', got {self.invalid!r}")
        self._bot = Opponent(self.opponent, self.seed)

    def decision_prompt(self) -> str | None:
        if self._pending is not None:
            return None
        t = len(self.history)
        parts = [f"Round {t + 1}."]
        if self.history:
            p, o = self.history[-1]
            shown = "no valid move" if p == "none" else p
            result = -1 if p == "none" else payoff(p, o)
            parts.append(f"Last round you played {shown}, the opponent played {o}: {_OUTCOME[result]}.")
        parts.append("Your move (rock, paper or scissors)?")
        return " ".join(parts)

    def act(self, reply: str) -> None:
        if self._pending is not None:
            raise RuntimeError("this round is already decided: call end_round()")
        t = len(self.history)
        opp = self._bot.move(self.history)
        move = parse_move(reply)
        parsed = move is not None
        if move is None and self.invalid == "random":
            move = random.Random(f"rps-invalid:{self.seed}:{t}:{reply}").choice(MOVES)
        if move is None:
            score, shown = -1, "none"
        else:
            score, shown = payoff(move, opp), move
        self.history.append((shown, opp))
        note = "" if parsed else " (no valid move in the reply" + (", random move)" if move else ", forfeit)")
        line = f"Round {t + 1}: you {shown}, opponent {opp} -> {_OUTCOME[score]}{note}"
        self._pending = RoundResult(index=t, payoff=float(score), won=score > 0, parsed=int(parsed), decisions=1, line=line)

    def end_round(self) -> RoundResult:
        if self._pending is None:
            raise RuntimeError("the round is not decided yet: call act() first")
        result, self._pending = self._pending, None
        return result


def make_match(opponent: str, seed: int, invalid: Literal["loss", "random"] = "loss") -> RPSMatch:
    """A rock-paper-scissors match against ``opponent`` (one of ``OPPONENTS``)."""
    return RPSMatch(opponent=opponent, seed=seed, invalid=invalid)
