"""LEAP for CUDA kernels: rank rewards for kernel groups, and the ``python -m learner.leap`` command.

    from learner.leap import KernelEpisode, kernel_rank_samples
    adv = compute_advantages("rank", kernel_rank_samples(episodes))

    python -m learner.leap --probe bench/data/leap_probe.jsonl [--max-turns 4] [--p-hi 1.0] [--s-hi 1.0] [--json]
    python -m learner.leap --expand --url URL --agent kernel-agent --problems 0-7 --group 4 [--api-key K] [--json]

Rank rewards: :func:`kernel_rank_samples` turns kernel episode outcomes (correct, speedup, output tokens)
into the :class:`learner.advantages.TurnSample` rows that the registered ``rank`` estimator expects
(correct beats incorrect, faster beats slower, fewer tokens break ties). An outcome whose correctness was
not measured has ``correct=None`` and is excluded (advantage 0): compile success is not correctness.

The command: ``--probe`` prints the difficulty-conditioned pruning (DCP, ``learner/leap_dcp.py``) of a recorded
probe; ``--expand`` probes kernel problems through a served agent, prunes them and expands the rest
(``learner/leap_expand.py``).

What it does not do: the DCP rule itself (``learner/leap_dcp.py``), sample, compile or run kernels (the probe is
recorded elsewhere, e.g. ``bench/leap_probe.py``, or probed on a running server by ``learner.leap_expand``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from learner.advantages import Advantages, TurnSample, compute_advantages
from learner.leap_dcp import load_probe, prune

__all__ = ["KernelEpisode", "kernel_rank_advantages", "kernel_rank_samples"]

# ---------------------------------------------------------------------------------------------------
# Rank rewards for kernel groups


@dataclass(frozen=True)
class KernelEpisode:
    """One turn of one kernel trajectory (a single-turn episode is one row with ``turn=0``)."""

    group_id: str  # the task (same problem -> same group)
    trajectory_id: str
    correct: bool | None  # None when correctness was not measured
    speedup: float | None = None  # only meaningful when correct
    n_tokens: int = 0
    turn: int = 0


def kernel_rank_samples(episodes: Iterable[KernelEpisode]) -> list[TurnSample]:
    """The ``TurnSample`` rows the ``rank`` estimator reads: ``correct``, ``score`` = speedup (kept only for a
    correct kernel), ``n_tokens``; ``trajectory_reward`` is Kevin's ``0.3 * correct + speedup * correct`` of the
    trajectory's last turn (NaN when not measured), for estimators other than rank."""
    rows = list(episodes)
    last: dict[str, KernelEpisode] = {}
    for e in rows:
        if e.trajectory_id not in last or e.turn > last[e.trajectory_id].turn:
            last[e.trajectory_id] = e

    def kevin(e: KernelEpisode) -> float | None:
        if e.correct is None:
            return None
        return 0.3 + (e.speedup or 0.0) if e.correct else 0.0

    return [
        TurnSample(
            trajectory_id=e.trajectory_id,
            group_id=e.group_id,
            turn_index=e.turn,
            reward=None,
            trajectory_reward=kevin(last[e.trajectory_id]),
            n_tokens=int(e.n_tokens),
            correct=e.correct,
            score=e.speedup if e.correct and e.speedup is not None and math.isfinite(e.speedup) else None,
        )
        for e in rows
    ]


def kernel_rank_advantages(episodes: Iterable[KernelEpisode], **params: Any) -> Advantages:
    """``compute_advantages("rank", kernel_rank_samples(episodes), **params)`` (``margin``, ``per``, ``normalize``)."""
    return compute_advantages("rank", kernel_rank_samples(episodes), **params)


# ---------------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m learner.leap",
        description="LEAP difficulty-conditioned pruning over a recorded probe (--probe), or probe + prune + expand on a server (--expand).",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--probe", type=Path, help="JSON lines, one first-turn sample per line (task, compiled, first_error, ...)")
    mode.add_argument("--expand", action="store_true", help="probe kernel problems through a served agent, prune, expand the rest")
    p.add_argument("--max-turns", type=int, default=4, help="turns of the multi-turn expansion (default 4, kernel-agent's cap)")
    p.add_argument("--p-hi", type=float, default=1.0, help="share correct for 'simple' (default 1.0)")
    p.add_argument("--s-hi", type=float, default=1.0, help="median speedup among the correct for 'simple' (default 1.0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    e = p.add_argument_group("--expand (learner.leap_expand)")
    e.add_argument("--url", default=os.environ.get("LOOPWISE_URL", "http://127.0.0.1:8000"), help="loopwise server base URL")
    e.add_argument("--api-key", default=os.environ.get("LOOPWISE_API_KEY"), help="API key of the server")
    e.add_argument("--agent", default="kernel-agent", help="the agent that runs the kernels task (default kernel-agent)")
    e.add_argument("--problems", default="0-7", help="problem indices and/or spec names: 0-7, 0,3,level1/relu (default 0-7)")
    e.add_argument("--group", type=int, default=4, help="G: probe samples and expansion episodes per problem (default 4)")
    e.add_argument("--seed", type=int, default=0, help="problem seed (default 0)")
    e.add_argument("--sample-seed", type=int, default=0, help="first sampling seed: probes use +0..G-1, episodes +G..2G-1 (default 0)")
    e.add_argument("--concurrency", type=int, default=8, help="runs in flight at once (default 8)")
    e.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    e.add_argument("--save-probe", type=Path, help="also write the probe samples as a file that --probe reads")
    args = p.parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # logs on stderr; stdout is for the report
    if args.expand:
        from learner.leap_expand import run_cli  # imports httpx: only for --expand

        return run_cli(args)
    try:
        probes = load_probe(args.probe)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not probes:
        print(f"error: {args.probe} holds no probe samples", file=sys.stderr)
        return 2
    report = prune(probes, max_turns=args.max_turns, p_hi=args.p_hi, s_hi=args.s_hi)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
