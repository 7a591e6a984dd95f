"""Heads-up limit Texas hold'em against seeded scripted opponents, on pokerkit's engine (``memory`` extra).

One round is one hand: blinds 1/2, small bet 2, big bet 4, both stacks reset to 200 chips every hand
(so hands are independent), four streets with pokerkit's raise cap. The player alternates seats:
hand ``t`` has the player on the button (small blind, acts first preflop) when ``t`` is odd, in the
big blind when it is even. Cards come from a deck shuffled by ``random.Random((seed, hand))``, so every
memory method sees the same cards in a game. Payoff of a hand = the player's chip change / big blind (2).

Opponents (``OPPONENTS``); "strong" = preflop a pair, two cards ten or higher, or a suited ace;
postflop one pair or better using a hole card (pokerkit's ``StandardHighHand``):

- ``station``: a calling station: always checks or calls, never bets, raises or folds.
- ``maniac``: bets or raises whenever it may, otherwise calls; never folds.
- ``rock``: plays strong hands only: with them it bets/raises, otherwise it checks when it can and folds to any bet.
- ``folder``: with a strong hand it calls (never raises); otherwise it folds to a bet with probability
  ``FOLD_P`` (0.8) and calls otherwise; checks when it can.
- ``mix``: each hand a seeded coin flip between ``station`` and ``maniac``.

The player's reply is one of the actions legal at the decision (``reply_schema``: fold/call/raise when
facing a bet, check/bet otherwise); free text is parsed leniently (first action word; ``call``/``check``
and ``bet``/``raise`` are treated alike, folding when nothing is to be called is a check, a raise at
the cap is a call). A reply without an action: ``invalid="loss"`` folds when facing a bet and checks
otherwise; ``invalid="random"`` draws a legal action from an RNG seeded by (seed, hand, decision, reply).

Not here: model calls or memory. Importing this module needs pokerkit (``pip install loopwise[memory]``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pokerkit import Automation, Card, Deck, FixedLimitTexasHoldem, Label, StandardHighHand, State

from memory.testbeds.match import RoundResult

ACTIONS = ("fold", "check", "call", "raise")  # every action a player can take (legal ones depend on the state)
OPPONENTS = ("station", "maniac", "rock", "folder", "mix")
FOLD_P = 0.8
STACK, SMALL_BLIND, BIG_BLIND, SMALL_BET, BIG_BET = 200, 1, 2, 2, 4
STREETS = ("preflop", "flop", "turn", "river")
_AUTOMATIONS = (
    Automation.ANTE_POSTING,
    Automation.BET_COLLECTION,
    Automation.BLIND_OR_STRADDLE_POSTING,
    Automation.HOLE_CARDS_SHOWING_OR_MUCKING,
    Automation.HAND_KILLING,
    Automation.CHIPS_PUSHING,
    Automation.CHIPS_PULLING,
)
_LABELS = list(Label)

RULES = (
    "You are playing heads-up limit Texas hold'em against the same opponent, hand after hand. "
    "Blinds are 1 and 2 chips, bets are 2 chips before the turn and 4 chips on the turn and river; stacks reset every hand. "
    "Cards are written rank then suit (T = ten; s, h, d, c = spades, hearts, diamonds, clubs). "
    "The opponent has habits that can be exploited. "
    "Answer each decision with exactly one of the actions offered."
)

_ACTION = re.compile(r"\b(fold|check|call|bet|raise)\b", re.IGNORECASE)


def parse_action(text: str) -> str | None:
    """The first action word in a reply (``fold``/``check``/``call``/``bet``/``raise``), or None."""
    m = _ACTION.search(text)
    return m.group(1).lower() if m else None


def strong(hole: list[Card], board: list[Card]) -> bool:
    """The scripted opponents' notion of a strong hand (see the module docstring)."""
    if not board:
        a, b = hole
        ranks = "23456789TJQKA"
        ra, rb = ranks.index(str(a.rank)), ranks.index(str(b.rank))
        return ra == rb or min(ra, rb) >= ranks.index("T") or (a.suit == b.suit and "A" in (str(a.rank), str(b.rank)))
    hand = StandardHighHand.from_game(hole, board)
    board_only = StandardHighHand.from_game([], board) if len(board) >= 5 else None
    if board_only is not None and not hand > board_only:  # the board plays: no help from the hole cards
        return False
    return _LABELS.index(hand.entry.label) >= _LABELS.index(Label.ONE_PAIR)


def cards(cs: list[Card]) -> str:
    return " ".join(repr(c) for c in cs) or "-"


@dataclass
class HoldemMatch:
    """Heads-up limit hold'em against one scripted opponent; several decisions per hand."""

    opponent: str
    seed: int
    invalid: Literal["loss", "random"] = "loss"
    testbed: str = "holdem"
    rules: str = RULES
    hands: list[RoundResult] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _state: State | None = field(init=False, default=None)
    _deck: list[Card] = field(init=False, default_factory=list)
    _holes: list[list[Card]] = field(init=False, default_factory=list)
    _next_board: int = field(init=False, default=4)
    _seat: int = field(init=False, default=0)
    _style: str = field(init=False, default="")
    _log: list[str] = field(init=False, default_factory=list)
    _decisions: int = field(init=False, default=0)
    _parsed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.opponent not in OPPONENTS:
            raise ValueError(f"unknown holdem opponent {self.opponent!r}; known: {', '.join(OPPONENTS)}")
        if self.invalid not in ("loss", "random"):
            raise ValueError(f"invalid must be 'loss' or 'random', got {self.invalid!r}")
        self._rng = random.Random(f"holdem:{self.opponent}:{self.seed}")
        self._deal()

    # -- the hand ------------------------------------------------------------------------------

    def _deal(self) -> None:
        t = len(self.hands)
        deck = list(Deck.STANDARD)
        random.Random(f"holdem-deck:{self.seed}:{t}").shuffle(deck)
        self._deck = deck
        self._state = FixedLimitTexasHoldem.create_state(
            _AUTOMATIONS, True, 0, (SMALL_BLIND, BIG_BLIND), SMALL_BET, BIG_BET, STACK, 2
        )  # seat 0 posts the big blind, seat 1 is the button (small blind)
        self._seat = 1 if t % 2 else 0
        self._holes = [deck[0:2], deck[2:4]]  # by seat; pokerkit mucks them at the end of the hand
        self._state.deal_hole(deck[0:2])
        self._state.deal_hole(deck[2:4])
        self._next_board = 4
        self._style = self.opponent if self.opponent != "mix" else self._rng.choice(("station", "maniac"))
        self._log, self._decisions, self._parsed = [], 0, 0

    @property
    def state(self) -> State:
        assert self._state is not None
        return self._state

    def _board(self) -> list[Card]:
        return [c for cs in self.state.board_cards for c in cs]

    def _street(self) -> str:
        return STREETS[min(len(self._board()) - 2, 3)] if self._board() else "preflop"

    def _advance(self) -> None:
        """Deal boards and play the opponent until the player must act or the hand is over."""
        st = self.state
        while st.status:
            if st.can_burn_card():  # burn and deal from our seeded deck only
                st.burn_card(self._deck[self._next_board])
                self._next_board += 1
            elif st.can_deal_board():
                n = 3 if not self._board() else 1
                st.deal_board(self._deck[self._next_board : self._next_board + n])
                self._next_board += n
            elif st.actor_index == self._seat:
                return
            elif st.actor_index is not None:
                self._apply(1 - self._seat, self._opponent_action())
            else:
                return

    def _facing_bet(self) -> bool:
        """Whether the player to act faces a bet (pokerkit has no calling amount while nobody is to act)."""
        to_call = self.state.checking_or_calling_amount
        assert to_call is not None, "no player is to act"
        return to_call > 0

    def _legal(self) -> list[str]:
        st = self.state
        facing = self._facing_bet()
        raise_ok = st.can_complete_bet_or_raise_to()
        if facing:
            return ["fold", "call", *(["raise"] if raise_ok else [])]
        return ["check", *(["bet"] if raise_ok else [])]

    def _apply(self, seat: int, action: str) -> None:
        st = self.state
        legal = self._legal()
        if action in ("bet", "raise") and not st.can_complete_bet_or_raise_to():
            action = "call" if "call" in legal else "check"
        if action == "fold" and "fold" not in legal:
            action = "check"
        if action in ("call", "check"):
            action = "call" if "call" in legal else "check"
        if action in ("bet", "raise"):
            action = "raise" if "raise" in legal else "bet"
        who = "you" if seat == self._seat else "opponent"
        self._log.append(f"{self._street()} {who} {action}")
        if action == "fold":
            st.fold()
        elif action in ("call", "check"):
            st.check_or_call()
        else:
            st.complete_bet_or_raise_to()

    def _opponent_action(self) -> str:
        good = strong(self._holes[1 - self._seat], self._board())
        facing = self._facing_bet()
        style = self._style
        if style == "station":
            return "call"
        if style == "maniac":
            return "raise"
        if style == "rock":
            return "raise" if good else ("fold" if facing else "check")
        # folder
        if good:
            return "call"
        if facing and self._rng.random() < FOLD_P:
            return "fold"
        return "call"

    # -- the Match protocol ------------------------------------------------------------------

    @property
    def reply_schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": self._legal() if self.state.status else ["check"]}

    def decision_prompt(self) -> str | None:
        self._advance()
        st = self.state
        if not st.status:
            return None
        hole = self._holes[self._seat]
        pos = "the button (small blind)" if self._seat == 1 else "the big blind"
        to_call = st.checking_or_calling_amount
        parts = [
            f"Hand {len(self.hands) + 1}, {self._street()}. You are on {pos}.",
            f"Your cards: {cards(hole)}. Board: {cards(self._board())}. Pot: {st.total_pot_amount} chips.",
        ]
        if self._log:
            parts.append("Actions so far: " + "; ".join(self._log) + ".")
        parts.append(f"To call: {to_call} chips." if to_call else "Nothing to call.")
        parts.append(f"Your action ({', '.join(self._legal())})?")
        return " ".join(parts)

    def act(self, reply: str) -> None:
        if not self.state.status or self.state.actor_index != self._seat:
            raise RuntimeError("no decision is pending: call decision_prompt() first")
        legal = self._legal()
        action = parse_action(reply)
        self._decisions += 1
        if action is not None:
            self._parsed += 1
        elif self.invalid == "random":
            action = random.Random(f"holdem-invalid:{self.seed}:{len(self.hands)}:{self._decisions}:{reply}").choice(legal)
        else:
            action = "fold" if "fold" in legal else "check"
        self._apply(self._seat, action)

    def end_round(self) -> RoundResult:
        self._advance()
        st = self.state
        if st.status:
            raise RuntimeError("the hand is not over yet: answer decision_prompt() first")
        chips = st.stacks[self._seat] - STACK
        payoff = chips / BIG_BLIND
        t = len(self.hands)
        opp_hole = cards(self._holes[1 - self._seat]) if not any(a.endswith(" fold") for a in self._log) else "hidden"
        line = (
            f"Hand {t + 1} ({'button' if self._seat == 1 else 'big blind'}; you {cards(self._holes[self._seat])}, "
            f"board {cards(self._board())}, opponent {opp_hole}): {'; '.join(self._log)} -> {payoff:+g} big blinds"
        )
        result = RoundResult(index=t, payoff=payoff, won=payoff > 0, parsed=self._parsed, decisions=self._decisions, line=line)
        self.hands.append(result)
        self._deal()
        return result


def make_match(opponent: str, seed: int, invalid: Literal["loss", "random"] = "loss") -> HoldemMatch:
    """A limit hold'em match against ``opponent`` (one of ``OPPONENTS``)."""
    return HoldemMatch(opponent=opponent, seed=seed, invalid=invalid)
