"""Testbeds: RPS and hold'em scripted opponents behave as specified, replies parse leniently, payoffs, invalid replies."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from memory.testbeds import make_match, opponents
from memory.testbeds.match import RoundResult
from memory.testbeds.rps import BEATS, BIAS_P, CYCLES, MIX_P, MOVES, Opponent, parse_move, payoff


def play(opp: Opponent, player_moves: list[str]) -> list[str]:
    """The opponent's moves against a fixed sequence of player moves."""
    history: list[tuple[str, str]] = []
    for p in player_moves:
        history.append((p, opp.move(history)))
    return [o for _, o in history]


def test_payoff_table() -> None:
    assert [payoff("rock", o) for o in MOVES] == [0, -1, 1]
    assert [payoff("paper", o) for o in MOVES] == [1, 0, -1]
    assert [payoff("scissors", o) for o in MOVES] == [-1, 1, 0]
    assert all(payoff(BEATS[m], m) == 1 for m in MOVES)


@pytest.mark.parametrize("seed", range(6))
def test_cycle_repeats_its_cycle_whatever_the_player_does(seed: int) -> None:
    opp = Opponent("cycle", seed)
    assert opp.cycle in CYCLES
    moves = play(opp, ["rock"] * 12)
    again = play(Opponent("cycle", seed), ["scissors", "paper"] * 6)
    assert moves == again  # independent of the player
    k = len(opp.cycle)
    assert moves == [opp.cycle[(opp.offset + t) % k] for t in range(12)]


def test_bias_plays_its_favourite_about_seventy_percent() -> None:
    opp = Opponent("bias", 3)
    counts = Counter(play(opp, ["rock"] * 4000))
    assert abs(counts[opp.favourite] / 4000 - BIAS_P) < 0.03
    for m in MOVES:
        if m != opp.favourite:
            assert abs(counts[m] / 4000 - (1 - BIAS_P) / 2) < 0.03


def test_win_stay_lose_shift() -> None:
    opp = Opponent("wsls", 0)
    first = opp.move([])
    assert first in MOVES
    # it won with paper against rock: stays on paper
    assert opp.move([("rock", "paper")]) == "paper"
    # it lost with rock against paper: plays what beats the player's last move (scissors)
    assert opp.move([("paper", "rock")]) == "scissors"
    # draw: also shifts to what beats the player's last move
    assert opp.move([("scissors", "scissors")]) == "rock"


def test_copy_and_beat_last() -> None:
    player = ["rock", "paper", "paper", "scissors", "rock"]
    copied = play(Opponent("copy", 1), player)
    assert copied[1:] == player[:-1]
    beaten = play(Opponent("beat-last", 1), player)
    assert beaten[1:] == [BEATS[m] for m in player[:-1]]


def test_mix_copies_mostly() -> None:
    player = [MOVES[(t * 7) % 3] for t in range(3000)]
    moves = play(Opponent("mix", 2), player)
    share = sum(moves[t] == player[t - 1] for t in range(1, 3000)) / 2999
    assert abs(share - (MIX_P + (1 - MIX_P) / 3)) < 0.03  # copy, or a uniform draw that happens to match


def test_opponents_are_seeded() -> None:
    for kind in opponents("rps"):
        moves = ["rock", "scissors", "paper", "paper"] * 5
        assert play(Opponent(kind, 7), moves) == play(Opponent(kind, 7), moves)
    assert len({tuple(play(Opponent("bias", s), ["rock"] * 20)) for s in range(5)}) > 1
    with pytest.raises(ValueError, match="unknown rps opponent"):
        Opponent("random", 0)


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("rock", "rock"),
        ("  **Paper**.", "paper"),
        ("Scissor!", "scissors"),
        ("I will play scissors to beat paper", "scissors"),
        ("My move: rock", "rock"),
        ("The opponent likes rock, so I choose paper.", "paper"),
        ("Hmm... let me think. Paper wins here.", "paper"),
        ("S", "scissors"),
        ("r.", "rock"),
        ("✌️", "scissors"),
        ("I don't know", None),
        ("", None),
        ("rocket science", None),
    ],
)
def test_parse_move(text: str, move: str | None) -> None:
    assert parse_move(text) == move


def test_match_flow_and_an_exploit_of_copy() -> None:
    match = make_match("rps", "copy", 0)
    total = []
    last = "rock"
    for t in range(6):
        prompt = match.decision_prompt()
        assert prompt is not None and prompt.startswith(f"Round {t + 1}.")
        move = BEATS[last]  # copy plays our last move: beat it
        match.act(f"{move}")
        assert match.decision_prompt() is None
        with pytest.raises(RuntimeError):
            match.act("rock")
        r = match.end_round()
        assert r.index == t and r.decisions == 1 and r.parsed == 1
        total.append(r.payoff)
        last = move
    assert total[1:] == [1.0] * 5
    assert "you won" in match.decision_prompt()  # type: ignore[operator]
    with pytest.raises(RuntimeError):
        match.end_round()


def test_invalid_reply_forfeits_or_plays_a_reply_seeded_move() -> None:
    m = make_match("rps", "cycle", 0)
    m.act("no idea")
    r = m.end_round()
    assert (r.payoff, r.parsed, r.won) == (-1.0, 0, False)
    assert m.history[0][0] == "none" and "forfeit" in r.line
    assert "no valid move" in (m.decision_prompt() or "")
    m.act("rock")  # a history-based opponent after a forfeit: fine, and a cycle keeps cycling
    assert m.end_round().parsed == 1

    def random_move(reply: str) -> str:
        x = make_match("rps", "cycle", 0, invalid="random")
        x.act(reply)
        x.end_round()
        return x.history[0][0]

    assert random_move("blah") == random_move("blah")
    assert {random_move(f"blah {i}") for i in range(30)} == set(MOVES)
    for kind in ("copy", "wsls", "beat-last", "mix"):
        h = make_match("rps", kind, 0)
        h.act("???")
        h.end_round()
        h.act("???")  # the opponent repeats its own last move after a forfeit
        h.end_round()
        assert h.history[1][1] == h.history[0][1]
    with pytest.raises(ValueError, match="invalid"):
        make_match("rps", "copy", 0, invalid="skip")


# -- limit hold'em (pokerkit, the ``memory`` extra) ---------------------------------------------------


def play_hand(match: Any, choose: Callable[[str, list[str]], str]) -> RoundResult:
    """Play one hold'em hand with ``choose(prompt, legal actions)``."""
    while (prompt := match.decision_prompt()) is not None:
        match.act(choose(prompt, match.reply_schema["enum"]))
    return match.end_round()


def test_holdem_opponents_and_hands() -> None:
    holdem = pytest.importorskip("memory.testbeds.holdem", reason="pokerkit (the memory extra) is not installed")
    assert opponents("holdem") == holdem.OPPONENTS
    # a calling station never folds or raises; a maniac never folds and raises when it can
    for kind, banned in (("station", (" fold", " raise", " bet")), ("maniac", (" fold", " check"))):
        m = make_match("holdem", kind, 0)
        for _ in range(12):
            r = play_hand(m, lambda p, legal: "raise" if "raise" in legal else "call" if "call" in legal else "bet")
            opp = [a for a in r.line.split(": ", 1)[1].split(" -> ")[0].split("; ") if " opponent " in f" {a} "]
            assert opp and not any(a.endswith(b) for a in opp for b in banned), r.line
    # against a rock, betting every street wins the blinds whenever it holds nothing strong
    rock = make_match("holdem", "rock", 1)
    results = [play_hand(rock, lambda p, legal: "bet" if "bet" in legal else "raise" if "raise" in legal else "call") for _ in range(20)]
    assert any("opponent fold" in r.line for r in results)
    # a folder folds to most bets without a strong hand
    folder = make_match("holdem", "folder", 2)
    folds = sum("opponent fold" in play_hand(folder, lambda p, legal: "raise" if "raise" in legal else "bet").line for _ in range(30))
    assert folds >= 10
    # payoffs are chip changes in big blinds and zero-sum against the blinds posted; seats alternate
    m = make_match("holdem", "station", 3)
    first = play_hand(m, lambda p, legal: "fold" if "fold" in legal else "check")
    assert "big blind" in first.line.split(";")[0]
    second = play_hand(m, lambda p, legal: "fold" if "fold" in legal else "check")
    assert "button" in second.line.split(";")[0] and second.payoff == -0.5  # the button folds its small blind
    assert first.payoff in (0.0, 1.0, -1.0) or first.payoff % 0.5 == 0


def test_holdem_is_seeded_and_parses_actions() -> None:
    holdem = pytest.importorskip("memory.testbeds.holdem", reason="pokerkit (the memory extra) is not installed")
    assert holdem.parse_action("I think I should **Raise** here") == "raise"
    assert holdem.parse_action("Check.") == "check"
    assert holdem.parse_action("calling station") is None
    lines = [play_hand(make_match("holdem", "mix", 5), lambda p, legal: legal[-1]).line for _ in range(2)]
    assert lines[0] == lines[1]
    a, b = make_match("holdem", "station", 5), make_match("holdem", "station", 6)
    assert play_hand(a, lambda p, legal: "call").line != play_hand(b, lambda p, legal: "call").line
    # an invalid reply folds when facing a bet (loss) and is a legal random action otherwise
    m = make_match("holdem", "maniac", 0)
    prompt = m.decision_prompt()
    assert prompt is not None and prompt.startswith("Hand 1, preflop.")
    while "To call" not in (prompt or ""):
        m.act("check")
        prompt = m.decision_prompt()
    m.act("hmm")
    r = m.end_round()
    assert r.line.rstrip().split(" -> ")[0].endswith("you fold") and r.parsed < r.decisions
    assert m.decision_prompt() is not None
    with pytest.raises(RuntimeError, match="not over"):
        m.end_round()  # the next hand has a pending decision
    with pytest.raises(ValueError, match="unknown holdem opponent"):
        make_match("holdem", "shark", 0)
