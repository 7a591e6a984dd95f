"""RPS testbed: scripted opponents behave as specified, moves parse leniently, payoffs and invalid replies."""

from __future__ import annotations

from collections import Counter

import pytest

from memory.testbeds import make_match, opponents
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
