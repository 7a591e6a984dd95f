"""Elo, bootstrap CIs and the learning slope on fixed tables; matches from game records; report and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.memory_tournament import (
    MatchResult,
    bootstrap_elo,
    fit_elo,
    included_games,
    learning_slope,
    main,
    matches_from_games,
    ols_slope,
    plot,
    render,
    summarize,
)
from memory.testbeds.match import RoundResult
from memory.testbeds.play import GameRecord, Rewrite


def games_of(table: list[tuple[str, str, str, float]]) -> list[MatchResult]:
    return [MatchResult(a, b, s, unit) for unit, a, b, s in table]


def test_symmetric_results_give_equal_ratings() -> None:
    cyclic = games_of([("u1", "a", "b", 1), ("u2", "b", "c", 1), ("u3", "c", "a", 1)])
    for prior in (None, 400.0):
        elo = fit_elo(["a", "b", "c"], cyclic, prior_sd=prior)
        assert all(math.isclose(v, 1500, abs_tol=1e-6) for v in elo.values())
    draws = games_of([("u1", "a", "b", 0.5), ("u2", "a", "b", 0.5)])
    assert fit_elo(["a", "b"], draws) == pytest.approx({"a": 1500, "b": 1500})


def test_two_player_closed_form() -> None:
    # Bradley-Terry MLE for two players: Elo difference = 400 log10(score_a / score_b)
    table = games_of([("u1", "a", "b", 1), ("u2", "a", "b", 1), ("u3", "a", "b", 1), ("u4", "a", "b", 0)])
    elo = fit_elo(["a", "b"], table, prior_sd=None)
    assert elo["a"] - elo["b"] == pytest.approx(400 * math.log10(3), abs=1e-6)
    assert elo["a"] + elo["b"] == pytest.approx(3000)
    with_draw = games_of([("u1", "a", "b", 1), ("u2", "a", "b", 1), ("u3", "a", "b", 0.5), ("u4", "a", "b", 0)])
    elo = fit_elo(["a", "b"], with_draw, prior_sd=None)
    assert elo["a"] - elo["b"] == pytest.approx(400 * math.log10(2.5 / 1.5), abs=1e-6)
    # the prior shrinks towards 1500, never past it
    shrunk = fit_elo(["a", "b"], table, prior_sd=200)
    assert 0 < shrunk["a"] - shrunk["b"] < 400 * math.log10(3)


def test_dominating_player_rated_highest_and_unbounded_mle_raises() -> None:
    table = games_of([("u1", "a", "b", 1), ("u1", "a", "c", 1), ("u1", "b", "c", 1), ("u2", "a", "b", 1), ("u2", "a", "c", 1), ("u2", "b", "c", 0.5)])
    elo = fit_elo(["a", "b", "c"], table)
    assert elo["a"] > elo["b"] > elo["c"]
    assert sum(elo.values()) == pytest.approx(4500)
    with pytest.raises(ValueError, match="unbounded"):
        fit_elo(["a", "b", "c"], table, prior_sd=None)


def test_bootstrap_ci_contains_the_estimate_and_narrows_with_more_games() -> None:
    base = [("a", "b", 1.0), ("a", "b", 1.0), ("a", "b", 0.0), ("a", "b", 0.5), ("b", "a", 0.0), ("a", "b", 1.0)]

    def table(copies: int) -> list[MatchResult]:
        return [MatchResult(a, b, s, f"u{k}-{i}") for k in range(copies) for i, (a, b, s) in enumerate(base)]

    small, big = table(2), table(12)
    elo = fit_elo(["a", "b"], small)
    ci_small = bootstrap_elo(["a", "b"], small, n_boot=200, seed=1)
    ci_big = bootstrap_elo(["a", "b"], big, n_boot=200, seed=1)
    for p in ("a", "b"):
        lo, hi = ci_small[p]
        assert lo <= elo[p] <= hi
    width = {p: ci[p][1] - ci[p][0] for ci in (ci_small,) for p in ci}
    assert ci_big["a"][1] - ci_big["a"][0] < 0.6 * width["a"]
    assert ci_big["a"][0] > 1500  # a is better, and with enough games the CI says so


def test_ols_slope_and_learning_slope() -> None:
    assert ols_slope([0.0, 0.1, 0.2, 0.3]) == pytest.approx(0.1)
    assert ols_slope([0.5]) == 0.0
    assert ols_slope([1, 0, 1, 0]) == pytest.approx(-0.2)
    rising = [[0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1]]
    s = learning_slope(rising, n_boot=500)
    assert s.win_rate_by_round == [0.25, 0.25, 0.5, 1.0, 1.0, 1.0]
    assert s.slope == pytest.approx(ols_slope(s.win_rate_by_round))
    assert s.ci[0] <= s.slope <= s.ci[1] and s.ci[0] > 0
    flat = learning_slope([[1, 0, 1, 0], [0, 1, 0, 1]], n_boot=200)
    assert flat.slope == 0.0
    with pytest.raises(ValueError):
        learning_slope([], n_boot=10)


def game(method: str, opponent: str, seed: int, payoffs: list[float]) -> GameRecord:
    g = GameRecord(testbed="rps", opponent=opponent, seed=seed, method=method)
    for i, p in enumerate(payoffs):
        g.rounds.append(RoundResult(index=i, payoff=p, won=p > 0, parsed=1, decisions=1, line=f"round {i}"))
        g.episode_of_round.append(i // 2)
    return g


def test_matches_from_games_and_summary(tmp_path: Path) -> None:
    games = [
        game("none", "copy", 0, [0, -1, 0, 1]),  # total 0
        game("reflection", "copy", 0, [1, 1, 0, 1]),  # total 3
        game("memopilot@2", "copy", 0, [1, 1, 1, 1]),  # total 4
        game("none", "cycle", 0, [1, 0, -1, 0]),  # total 0
        game("reflection", "cycle", 0, [0, 0, 0, 0]),  # total 0
        game("memopilot@2", "cycle", 0, [-1, 1, 1, 1]),  # total 2
    ]
    ms = matches_from_games(games)
    assert len(ms) == 6
    by = {(m.unit, m.a, m.b): m.score_a for m in ms}
    assert by[("rps:copy:0", "memopilot@2", "none")] == 1.0
    assert by[("rps:copy:0", "none", "reflection")] == 0.0
    assert by[("rps:cycle:0", "none", "reflection")] == 0.5
    with pytest.raises(ValueError, match="twice"):
        matches_from_games([*games, game("none", "copy", 0, [0])])
    s = summarize(games, n_boot=200)
    rows = {r["method"]: r for r in s["ratings"]}
    assert s["ratings"][0]["method"] == "memopilot@2"
    assert rows["memopilot@2"]["match_score"] == 1.0
    assert rows["none"]["win_rate"] == pytest.approx(2 / 8)
    assert rows["memopilot@2"]["win_rate_by_round"] == [0.5, 1.0, 1.0, 1.0]
    text = render(s)
    assert "memopilot@2" in text.splitlines()[1]
    out = tmp_path / "t.png"
    plot({**s, "title": "test"}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_games_round_trip_and_earlier_arms_are_rated_together(tmp_path: Path) -> None:
    earlier = [game("none", "copy", 0, [0, 1, -1, 1]), game("reflection", "copy", 0, [1, 1, 1, 0])]
    earlier[0].rewrites.append(Rewrite(0, "", "m", "c", "turn-1", "traj-1", None))
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"games": [g.to_dict() for g in earlier]}))
    assert GameRecord.from_dict(earlier[0].to_dict()) == earlier[0]
    now = [game("memopilot@1", "copy", 0, [1, 1, 1, 1]), game("none", "copy", 0, [0, 0, 0, 0])]
    added = included_games([path], now)
    assert [g.method for g in added] == ["reflection"]  # "none" was played again in this run: this run's copy counts
    with pytest.raises(SystemExit, match="did not play"):
        included_games([path], [game("memopilot@1", "cycle", 0, [1, 1, 1, 1])])
    out = tmp_path / "rated.json"
    path2 = tmp_path / "later.json"
    path2.write_text(json.dumps({"games": [now[0].to_dict()]}))
    assert main(["--rate-only", "--include-games", str(path), "--include-games", str(path2), "--boot", "20", "--json-out", str(out)]) == 0
    rated = json.loads(out.read_text())["summary"]["ratings"]
    assert rated[0]["method"] == "memopilot@1" and len(rated) == 3
