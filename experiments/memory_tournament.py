"""``python -m experiments.memory_tournament``: memory methods round-robin on a testbed, Elo with bootstrap CIs, learning slope.

    python -m experiments.memory_tournament --testbed rps --spawn --model default --seeds 3 --rounds 20 --episode-rounds 5 \\
        [--methods none,append-all,reflection,memopilot] [--memopilot-version N --adapter-root DIR] \\
        [--json-out FILE] [--png FILE] [--include-games EARLIER.json]

Every method plays the same games: each (opponent, seed) of the testbed, ``--rounds`` rounds with the
frozen player, memory updated after every episode (``memory.testbeds.play``). ``--memopilot-version N``
adds the trained copilot ``memopilot@N`` as a fifth arm (loaded from ``DIR/memopilot/vN`` through the
admin API when ``--adapter-root`` is given). ``--include-games`` rates the arms of an earlier run's JSON
together with this run's (the same scripted games, e.g. the trained arm played after training).

Ratings (pure functions below, tested on fixed tables):

- **Matches.** In each game (opponent, seed) every pair of methods is one match, decided by the two
  methods' total payoff in that game: the higher wins (score 1), equal is a draw (0.5 each).
- **Elo.** Bradley-Terry fitted to all matches at once (order-free; not sequential K-factor Elo) by
  Newton's method: maximum a posteriori with an independent Gaussian prior of ``prior_sd`` Elo points
  (default 400) around 1500 on every rating, which keeps ratings finite when a method wins every match;
  ``prior_sd=None`` is the plain maximum-likelihood fit (ratings then centred on 1500); it raises
  when the MLE is unbounded (Zermelo's condition: the "scored against" graph is not strongly
  connected). Draws count as half a win for each side. ``Elo = 1500 + 400/ln 10 * strength``.
- **Confidence intervals.** Percentile bootstrap over games: resample the (opponent, seed) games with
  replacement, rebuild the matches, refit; 2.5th and 97.5th percentiles.
- **Test-time learning slope.** Per method, the win rate at each round index (mean over games) and the
  least-squares slope of win rate on round index, per round; its CI is the percentile bootstrap over games.

Not here: the games themselves (``memory.testbeds``), training the copilot (``experiments.memory_train``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from memory.methods import METHODS, get_method
from memory.testbeds import TESTBEDS, opponents
from memory.testbeds import actions as testbed_actions
from memory.testbeds.play import MEMOPILOT_FORMATS, PLAYER_CONTEXTS, GameRecord, PlayConfig, play_game

ELO_BASE = 1500.0
ELO_SCALE = 400.0 / math.log(10.0)  # Elo points per unit of Bradley-Terry strength


# ---------------------------------------------------------------------------------------------------
# pure rating functions


@dataclass(frozen=True)
class MatchResult:
    a: str
    b: str
    score_a: float  # 1 = a won, 0.5 = draw, 0 = b won
    unit: str = ""  # the game the match comes from (the bootstrap resamples units)


def matches_from_games(games: Sequence[GameRecord]) -> list[MatchResult]:
    """Every pair of methods that played the same (testbed, opponent, seed) game, decided by total payoff."""
    by_unit: dict[str, dict[str, float]] = {}
    for g in games:
        unit = f"{g.testbed}:{g.opponent}:{g.seed}"
        if g.method in by_unit.setdefault(unit, {}):
            raise ValueError(f"method {g.method!r} played game {unit} twice")
        by_unit[unit][g.method] = g.total_payoff
    out = []
    for unit, totals in by_unit.items():
        for a, b in itertools.combinations(sorted(totals), 2):
            ta, tb = totals[a], totals[b]
            out.append(MatchResult(a, b, 1.0 if ta > tb else 0.0 if ta < tb else 0.5, unit))
    return out


def fit_elo(
    players: Sequence[str], matches: Sequence[MatchResult], *, prior_sd: float | None = 400.0, max_iter: int = 100, tol: float = 1e-10
) -> dict[str, float]:
    """Bradley-Terry Elo ratings (see the module docstring); raises ``ValueError`` if the plain MLE is unbounded."""
    idx = {p: i for i, p in enumerate(players)}
    n = len(players)
    if n == 0:
        return {}
    a = np.array([idx[m.a] for m in matches], dtype=np.int64)
    b = np.array([idx[m.b] for m in matches], dtype=np.int64)
    s = np.array([m.score_a for m in matches], dtype=np.float64)
    lam = 0.0 if prior_sd is None else (ELO_SCALE / prior_sd) ** 2  # precision of the prior in strength units
    if prior_sd is None and not _strongly_connected(n, [(idx[m.a], idx[m.b], m.score_a) for m in matches]):
        raise ValueError(
            "the maximum-likelihood ratings are unbounded (some players never score against some others, e.g. one won every match): use prior_sd"
        )
    r = np.zeros(n)
    for _ in range(max_iter):
        p = 1.0 / (1.0 + np.exp(-(r[a] - r[b])))  # P(a beats b)
        resid = s - p
        grad = np.bincount(a, resid, n) - np.bincount(b, resid, n) - lam * r
        w = p * (1.0 - p)
        hess = np.zeros((n, n))
        np.add.at(hess, (a, a), -w)
        np.add.at(hess, (b, b), -w)
        np.add.at(hess, (a, b), w)
        np.add.at(hess, (b, a), w)
        hess -= lam * np.eye(n)
        step = np.linalg.lstsq(hess, -grad, rcond=None)[0]  # singular without a prior: min-norm step
        r = r + step
        r -= r.mean()
        if np.max(np.abs(step)) < tol:
            break
    return {p: ELO_BASE + ELO_SCALE * float(r[i]) for p, i in idx.items()}


def _strongly_connected(n: int, results: Sequence[tuple[int, int, float]]) -> bool:
    """Whether "i scored against j" (a win or a draw) links every player to every other: Zermelo's condition
    for a finite Bradley-Terry maximum-likelihood estimate."""
    fwd: list[set[int]] = [set() for _ in range(n)]
    back: list[set[int]] = [set() for _ in range(n)]
    for a, b, s in results:
        if s > 0:
            fwd[a].add(b)
            back[b].add(a)
        if s < 1:
            fwd[b].add(a)
            back[a].add(b)

    def reach(edges: list[set[int]]) -> int:
        seen, todo = {0}, [0]
        while todo:
            for j in edges[todo.pop()] - seen:
                seen.add(j)
                todo.append(j)
        return len(seen)

    return reach(fwd) == n and reach(back) == n


def _units(matches: Sequence[MatchResult]) -> dict[str, list[MatchResult]]:
    out: dict[str, list[MatchResult]] = {}
    for m in matches:
        out.setdefault(m.unit, []).append(m)
    return out


def bootstrap_elo(
    players: Sequence[str],
    matches: Sequence[MatchResult],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
    prior_sd: float | None = 400.0,
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap CI of each player's Elo, resampling match units (games) with replacement."""
    units = list(_units(matches).values())
    rng = np.random.default_rng(seed)
    draws = np.empty((n_boot, len(players)))
    for k in range(n_boot):
        pick = rng.integers(0, len(units), len(units))
        sample = [m for i in pick for m in units[i]]
        ratings = fit_elo(players, sample, prior_sd=prior_sd)
        draws[k] = [ratings[p] for p in players]
    lo, hi = np.quantile(draws, [alpha / 2, 1 - alpha / 2], axis=0)
    return {p: (float(lo[i]), float(hi[i])) for i, p in enumerate(players)}


def ols_slope(y: Sequence[float]) -> float:
    """Least-squares slope of ``y`` on its index 0..T-1 (0.0 for fewer than two points)."""
    v = np.asarray(y, dtype=np.float64)
    if v.size < 2:
        return 0.0
    x = np.arange(v.size, dtype=np.float64)
    x -= x.mean()
    return float((x * (v - v.mean())).sum() / (x * x).sum())


@dataclass(frozen=True)
class Slope:
    slope: float  # win rate change per round
    ci: tuple[float, float]
    win_rate_by_round: list[float]


def learning_slope(wins: Sequence[Sequence[float]], *, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05) -> Slope:
    """Win-rate-by-round slope of a method: ``wins[g][t]`` is 1/0 for game ``g``, round ``t``; CI by bootstrap over games."""
    w = np.asarray(wins, dtype=np.float64)  # (G, T)
    if w.ndim != 2 or w.shape[0] == 0:
        raise ValueError("wins must be a non-empty (games, rounds) table")
    curve = w.mean(axis=0)
    rng = np.random.default_rng(seed)
    boots = [ols_slope(w[rng.integers(0, w.shape[0], w.shape[0])].mean(axis=0)) for _ in range(n_boot)]
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return Slope(slope=ols_slope(curve), ci=(float(lo), float(hi)), win_rate_by_round=[float(c) for c in curve])


def summarize(games: Sequence[GameRecord], *, n_boot: int = 1000, seed: int = 0, prior_sd: float | None = 400.0) -> dict[str, Any]:
    """Elo with CIs, payoff, win rate, parse rate and learning slope per method, ranked by Elo."""
    players = sorted({g.method for g in games})
    matches = matches_from_games(games)
    elo = fit_elo(players, matches, prior_sd=prior_sd)
    ci = bootstrap_elo(players, matches, n_boot=n_boot, seed=seed, prior_sd=prior_sd)
    rows: list[dict[str, Any]] = []  # one JSON row per method
    for p in players:
        mine = [g for g in games if g.method == p]
        rounds = min(len(g.rounds) for g in mine)
        slope = learning_slope([[float(r.won) for r in g.rounds[:rounds]] for g in mine], n_boot=n_boot, seed=seed)
        wins = sum(m.score_a for m in matches if m.a == p) + sum(1 - m.score_a for m in matches if m.b == p)
        played = sum(1 for m in matches if p in (m.a, m.b))
        rows.append(
            {
                "method": p,
                "elo": elo[p],
                "elo_ci": list(ci[p]),
                "match_score": wins / played if played else None,
                "games": len(mine),
                "mean_payoff_per_round": float(np.mean([g.total_payoff / len(g.rounds) for g in mine])),
                "win_rate": float(np.mean([r.won for g in mine for r in g.rounds])),
                "parse_rate": float(np.mean([g.parse_rate for g in mine])),
                "slope": slope.slope,
                "slope_ci": list(slope.ci),
                "win_rate_by_round": slope.win_rate_by_round,
            }
        )
    rows.sort(key=lambda r: -r["elo"])
    return {"ratings": rows, "matches": len(matches), "rating_method": "Bradley-Terry MAP (Gaussian prior) fit, percentile bootstrap over games"}


def render(summary: Mapping[str, Any]) -> str:
    lines = [f"{'method':<16}{'Elo':>7}  {'95% CI':<15}{'payoff/rd':>10}{'win rate':>9}{'parsed':>8}  slope/rd [95% CI]"]
    for r in summary["ratings"]:
        lo, hi = r["elo_ci"]
        slo, shi = r["slope_ci"]
        lines.append(
            f"{r['method']:<16}{r['elo']:>7.0f}  [{lo:>5.0f}, {hi:>5.0f}] {r['mean_payoff_per_round']:>+10.3f}{r['win_rate']:>9.3f}"
            f"{r['parse_rate']:>8.2f}  {r['slope']:+.4f} [{slo:+.4f}, {shi:+.4f}]"
        )
    return "\n".join(lines)


def plot(summary: Mapping[str, Any], path: Path) -> None:
    """Elo with CIs (left) and win rate by round (right) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["ratings"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"] for r in rows]
    elo = np.array([r["elo"] for r in rows])
    err = np.array([[r["elo"] - r["elo_ci"][0], r["elo_ci"][1] - r["elo"]] for r in rows]).T
    ax1.errorbar(elo, range(len(rows)), xerr=err, fmt="o", capsize=4)
    ax1.set_yticks(range(len(rows)), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("Elo (95% bootstrap CI)")
    for r in rows:
        ax2.plot(range(1, len(r["win_rate_by_round"]) + 1), r["win_rate_by_round"], marker=".", label=f"{r['method']} ({r['slope']:+.3f}/rd)")
    ax2.set_xlabel("round")
    ax2.set_ylabel("win rate")
    ax2.legend(fontsize=8)
    fig.suptitle(summary.get("title", "memory tournament"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# the CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory_tournament", description="Memory methods round-robin on a testbed, through a server."
    )
    add_server_args(p)
    p.add_argument("--testbed", choices=TESTBEDS, default="rps")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--memopilot-version", type=int, help="also play the trained copilot memopilot@N")
    p.add_argument("--opponents", default="all", help="comma-separated scripted opponents (default all of the testbed)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 per opponent (default 3)")
    p.add_argument("--rounds", type=int, default=20, help="rounds per game (default 20)")
    p.add_argument("--episode-rounds", type=int, default=5, help="rounds between memory updates (default 5)")
    p.add_argument("--memory-chars", type=int, default=600, help="memory bound in characters (default 600)")
    p.add_argument("--copilot-max-tokens", type=int, default=160)
    p.add_argument("--copilot-temperature", type=float, default=0.7)
    p.add_argument("--player-max-tokens", type=int, default=8)
    p.add_argument("--player-temperature", type=float, default=0.0, help="player sampling temperature (seeded per decision; default 0)")
    p.add_argument("--free-player", action="store_true", help="no constrained decoding: the player's free text is parsed")
    p.add_argument(
        "--player-context",
        choices=PLAYER_CONTEXTS,
        default="state",
        help="state: a fresh request per decision with the episode's rounds so far (default); chat: one growing chat per episode",
    )
    p.add_argument(
        "--memory-in",
        choices=["user", "system"],
        default="user",
        help="state context: the memory goes in the player's user message (default) or its system prompt",
    )
    p.add_argument(
        "--memopilot-format",
        choices=MEMOPILOT_FORMATS,
        default="json",
        help='json: memopilot writes {"note", "next"} over the game\'s actions (default); text: free-text memory',
    )
    p.add_argument(
        "--invalid",
        choices=["loss", "random"],
        default="loss",
        help="a reply without a legal action forfeits (rps: loses the round; holdem: folds or checks) or plays a random one",
    )
    p.add_argument("--concurrency", type=int, default=8, help="games in flight at once (default 8)")
    p.add_argument("--boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--json-out", type=Path, help="write games and summary as JSON")
    p.add_argument(
        "--include-games",
        type=Path,
        action="append",
        default=[],
        help="rate together with the games of an earlier --json-out (same testbed, opponents, seeds, rounds; e.g. a later trained arm)",
    )
    p.add_argument("--rate-only", action="store_true", help="play nothing: rate the --include-games files' games together (no server)")
    p.add_argument("--png", type=Path, help="write the Elo and learning-curve plot")
    return p


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``--url`` / ``--spawn --model`` / keys / ``--adapter-root``, shared with ``experiments.memory_train``."""
    p.add_argument("--url", default=os.environ.get("LOOPWISE_URL", "http://127.0.0.1:8000"), help="loopwise server base URL")
    p.add_argument("--spawn", action="store_true", help="start a private serve.py (with --model) instead of using --url")
    p.add_argument("--model", default="default", help="model of the spawned server: default (SmolLM2) | tiny | PATH")
    p.add_argument("--player-model", help="served name of the frozen player (default: the server's base model)")
    p.add_argument("--api-key", default=os.environ.get("LOOPWISE_API_KEY"))
    p.add_argument("--admin-key", default=os.environ.get("LOOPWISE_ADMIN_KEY"), help="admin key (loading memopilot adapters)")
    p.add_argument("--adapter-root", type=Path, help="adapter root the memopilot versions are published in (given to a spawned server)")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra serve.py argument for --spawn (repeatable, e.g. --server-arg=--threads=2)"
    )


@contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """The server to use: a spawned private one (``--spawn``, with an admin key) or ``--url``."""
    if not args.spawn:
        yield args.url
        return
    from experiments.agent_eval import spawned_server

    args.admin_key = args.admin_key or f"memory-{os.getpid()}"
    extra = list(args.server_arg)
    if args.adapter_root is not None:
        args.adapter_root.mkdir(parents=True, exist_ok=True)
        extra += ["--adapter-root", str(args.adapter_root.resolve())]
    with spawned_server(args.model, args.admin_key, extra_args=extra) as url:
        yield url


def base_model_name(client: httpx.Client) -> str:
    """The served base model (the first ``owned_by: loopwise`` entry of ``/v1/models``)."""
    r = client.get("/v1/models")
    r.raise_for_status()
    for m in r.json()["data"]:
        if m.get("owned_by") == "loopwise" and "@" not in m["id"]:
            return str(m["id"])
    raise SystemExit("error: the server lists no base model")


def load_memopilot(url: str, admin_key: str | None, adapter_root: Path, version: int) -> None:
    """Load ``adapter_root/memopilot/v<version>`` as ``memopilot@version`` unless the server already has it."""
    from learner.publish import RuntimeAdmin, adapter_path
    from learner.records.adapter_manifest import manifest_sha256

    if not admin_key:
        raise SystemExit("error: loading a memopilot adapter needs --admin-key (or --spawn)")
    with RuntimeAdmin(url, admin_key) as admin:
        if any(a.get("name") == f"memopilot@{version}" for a in admin.list_adapters()["data"]):
            return
        path = adapter_path(adapter_root, "memopilot", version).resolve()
        admin.load(path, "memopilot", version, sha256=manifest_sha256(path))


async def play_all(
    url: str, headers: dict[str, str], jobs: Sequence[tuple[str, str, int, str, PlayConfig, int]], concurrency: int
) -> list[GameRecord]:
    """Play ``(testbed, opponent, seed, method name, config, memory chars)`` jobs, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=900, limits=limits) as client:

        async def one(job: tuple[str, str, int, str, PlayConfig, int]) -> GameRecord:
            testbed, opp, seed, label, cfg, chars = job
            acts = testbed_actions(testbed) if cfg.memopilot_format == "json" else None
            method = get_method(label.split("@")[0], max_chars=chars, actions=acts)
            async with sem:
                return await play_game(client, testbed, opp, seed, method, cfg, label=label)

        return list(await asyncio.gather(*(one(j) for j in jobs)))


def included_games(paths: Sequence[Path], games: Sequence[GameRecord]) -> list[GameRecord]:
    """Games of earlier runs whose methods this run did not play; they must be the same (opponent, seed, rounds) games."""
    played = {g.method for g in games}
    keys = {(g.testbed, g.opponent, g.seed, len(g.rounds)) for g in games}
    out: list[GameRecord] = []
    for path in paths:
        for d in json.loads(path.read_text())["games"]:
            g = GameRecord.from_dict(d)
            if g.method in played:
                continue
            if (g.testbed, g.opponent, g.seed, len(g.rounds)) not in keys:
                raise SystemExit(f"error: {path} has a game ({g.testbed}, {g.opponent}, seed {g.seed}, {len(g.rounds)} rounds) this run did not play")
            out.append(g)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)  # fails early on an unknown name
    opps = opponents(args.testbed) if args.opponents == "all" else tuple(o.strip() for o in args.opponents.split(","))
    if args.memopilot_version is not None:
        methods.append(f"memopilot@{args.memopilot_version}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    t0 = time.perf_counter()
    if args.rate_only:
        return rate_only(args)
    with server_url(args) as url:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            player = args.player_model or base_model_name(c)
        if args.memopilot_version is not None and args.adapter_root is not None:
            load_memopilot(url, args.admin_key, args.adapter_root, args.memopilot_version)
        options = {"invalid": args.invalid}
        jobs = []
        for label in methods:
            cfg = PlayConfig(
                player_model=player,
                rounds=args.rounds,
                episode_rounds=args.episode_rounds,
                copilot_model=label if "@" in label else None,
                copilot_max_tokens=args.copilot_max_tokens,
                copilot_temperature=args.copilot_temperature,
                player_max_tokens=args.player_max_tokens,
                player_temperature=args.player_temperature,
                constrain_player=not args.free_player,
                player_context=args.player_context,
                memopilot_format=args.memopilot_format,
                memory_in=args.memory_in,
                match_options=options,
            )
            jobs += [(args.testbed, o, s, label, cfg, args.memory_chars) for o in opps for s in range(args.seeds)]
        games = asyncio.run(play_all(url, headers, jobs, args.concurrency))
    games += included_games(args.include_games, games)
    summary = summarize(games, n_boot=args.boot)
    summary.update(
        testbed=args.testbed,
        opponents=list(opps),
        seeds=args.seeds,
        rounds=args.rounds,
        episode_rounds=args.episode_rounds,
        player_model=player,
        elapsed_s=time.perf_counter() - t0,
        command="python -m experiments.memory_tournament " + " ".join(argv if argv is not None else sys.argv[1:]),
        title=f"{args.testbed}: {len(opps)} opponents x {args.seeds} seeds x {args.rounds} rounds, player {player}",
    )
    print(render(summary))
    print(f"({summary['matches']} matches, {len(games)} games, {summary['elapsed_s']:.0f} s)")
    write_outputs(args, summary, games)
    return 0


def rate_only(args: argparse.Namespace) -> int:
    """``--rate-only``: rate the games of the ``--include-games`` files together, without a server."""
    if not args.include_games:
        raise SystemExit("error: --rate-only needs --include-games FILE (one or more)")
    loaded = [json.loads(p.read_text()) for p in args.include_games]
    games = [GameRecord.from_dict(d) for data in loaded for d in data["games"]]
    first = loaded[0].get("summary", {})
    summary = summarize(games, n_boot=args.boot)
    summary.update({k: first[k] for k in ("testbed", "opponents", "seeds", "rounds", "episode_rounds", "player_model") if k in first})
    summary["sources"] = [str(p) for p in args.include_games]
    summary["title"] = first.get("title", "memory tournament")
    print(render(summary))
    print(f"({summary['matches']} matches, {len(games)} games)")
    write_outputs(args, summary, games)
    return 0


def write_outputs(args: argparse.Namespace, summary: dict[str, Any], games: Sequence[GameRecord]) -> None:
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"summary": summary, "games": [g.to_dict() for g in games]}, indent=1))
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(summary, args.png)


if __name__ == "__main__":
    sys.exit(main())
