"""LEAP expansion driver: probe kernel problems on a running server, prune them with DCP, expand the rest.

    from learner.leap_expand import expand
    report = expand("http://127.0.0.1:8000", None, "kernel-agent", [0, 1, "level1/relu"], G=4, max_turns=4)
    report.dcp.fraction_pruned, report.expanded, report.compile_calls_spent, report.format()

    python -m learner.leap --expand --url URL --agent kernel-agent --problems 0-7 --group 4 [--api-key K] [--json]

For each kernel problem (an index into the server's ``kernels`` task at problem seed ``seed``, or a problem
name such as ``level1/relu``, which the server resolves), :func:`expand`:

1. **probes**: ``G`` first-turn runs ``POST /v1/agents/{agent}/runs`` with ``{"task": "kernels",
   "problem_index": i | "problem_id": "kernels/<name>", "seed": seed, "sample_seed": sample_seed + k, "max_turns": 1}``;
2. turns each probe run into a :class:`learner.leap_dcp.ProbeSample` (:func:`probe_sample`) from the structured
   outcome the kernel Env reports for the first step (``steps[0].info.outcome``: whether code was found,
   whether it compiled and the first compiler error, whether it was measured, correct and how fast),
   cross-checked against the run's ``correct``; a step without that outcome raises :class:`ProbeParseError`;
3. calls :func:`learner.leap_dcp.prune` (which logs ``leap.dcp`` with the fraction pruned);
4. **expands** every kept (``useful``) problem into ``G`` full episodes of up to ``max_turns`` turns with
   fresh sampling seeds ``sample_seed + G + k`` (so they do not replay the probes' first turns).

Probe runs and episodes are ordinary, non-eval agent runs: the server records them with the Env's ``correct``
and score, and the learner trains on them like live traffic. Probes are tagged ``group: "leap-probe"``, so the
learner compares them only with each other (a one-turn probe is not a member of the G multi-turn episodes'
group). The learner process runs this engine itself before each update when ``[leap] enabled``
(``learner.config.LeapConfig``). The report counts compile calls
actually spent (one per step whose outcome shows a compile was attempted, i.e. a code block was found)
against the unpruned bound ``n_problems * G * max_turns`` (every problem expanded, one compile per turn), and
logs ``leap.expand``.

What it does not do: compile or run kernels itself (the server's kernel task does, through ``tools.cuda``),
continue a probe's trajectory (episodes start fresh), decide how a ``simple`` problem is trained, or start
a server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from learner.leap_dcp import ProbeSample, PruneReport, prune

__all__ = ["ExpandReport", "ProbeParseError", "RunFailed", "compile_calls", "expand", "parse_problems", "probe_sample", "problem_ref"]

log = structlog.get_logger(__name__)

TASK = "kernels"
PROBE_GROUP = "leap-probe"  # the probes' group tag: one-turn probes never join the multi-turn episodes' learner group


class ProbeParseError(ValueError):
    """A probe run without the kernel Env's structured outcome on its first step, or one that disagrees with the run's verdict."""


class RunFailed(RuntimeError):
    """The server answered a run request with an error."""


def _first_step(run: Mapping[str, Any]) -> Mapping[str, Any]:
    steps: Sequence[Mapping[str, Any]] = run.get("steps") or []
    if not steps:
        raise ProbeParseError(f"run {run.get('run_id')}: no steps")
    return steps[0]


_OUTCOME_FIELDS = ("found_code", "compiled", "compile_timed_out", "first_error", "measured", "correct", "speedup")


def _kernel_outcome(step: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The kernel Env's outcome of one run step (``step["info"]["outcome"]``), or None when the step has none."""
    info = step.get("info")
    outcome = info.get("outcome") if isinstance(info, Mapping) else None
    return outcome if isinstance(outcome, Mapping) and outcome else None


def probe_sample(run: Mapping[str, Any], task: str | None = None) -> ProbeSample:
    """The :class:`ProbeSample` of a probe run (its first step), as :func:`learner.leap_dcp.classify_probe` reads it.

    ``task`` defaults to the run's ``problem_id``. For a one-step run the outcome's correctness must agree with
    the run's ``correct`` (the Env's ``info["correct"]``; an unmeasured kernel is recorded as not correct)."""
    where = f"run {run.get('run_id')}"
    step = _first_step(run)
    outcome = _kernel_outcome(step)
    if outcome is None:
        raise ProbeParseError(f"{where}: the first step has no kernel outcome (a tool call instead of a kernel, or not the kernels task?)")
    fields: dict[str, Any] = {k: outcome.get(k) for k in _OUTCOME_FIELDS if outcome.get(k) is not None}
    if isinstance(fields.get("first_error"), str):
        fields["first_error"] = fields["first_error"].strip()[:300] or None
    name = task if task is not None else run.get("problem_id")
    if not name:
        raise ProbeParseError(f"{where}: no problem_id (not a task run?)")
    sample = ProbeSample(task=str(name), n_tokens=int(step.get("output_tokens") or 0), **fields)
    if len(run.get("steps") or []) == 1 and "correct" in run and bool(run["correct"]) != (sample.correct is True):
        raise ProbeParseError(f"{where}: the outcome says correct={sample.correct} but the run says correct={run['correct']}")
    return sample


def compile_calls(run: Mapping[str, Any]) -> int:
    """Compile calls a run spent: its steps whose outcome shows a compile was attempted (code found)."""
    return sum(1 for step in run.get("steps") or [] if (o := _kernel_outcome(step)) is not None and o.get("found_code"))


def parse_problems(spec: str) -> list[int | str]:
    """``"0-7"``, ``"0,2,5-6"`` or ``"level1/relu,3"``: indices (ranges inclusive) and spec names, in order."""
    out: list[int | str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if m := re.fullmatch(r"(\d+)-(\d+)", part):
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ValueError(f"empty range {part!r}")
            out.extend(range(lo, hi + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            out.append(part)
    if not out:
        raise ValueError(f"no problems in {spec!r}")
    return out


def problem_ref(item: int | str) -> dict[str, Any]:
    """A run body's problem: ``{"problem_index": i}``, or ``{"problem_id": "kernels/<name>"}`` for a name (the server resolves it)."""
    if isinstance(item, int):
        return {"problem_index": item}
    return {"problem_id": item if item.startswith(f"{TASK}/") else f"{TASK}/{item}"}


@dataclass
class ExpandReport:
    agent: str
    seed: int
    group: int
    max_turns: int
    problems: dict[str, int]  # problem id -> problem_index, in probe order
    dcp: PruneReport
    probe_runs: dict[str, list[str]]  # problem id -> run ids of its probe
    episodes: dict[str, list[dict[str, Any]]]  # expanded problem id -> one summary per episode
    compile_calls_probe: int
    compile_calls_expansion: int
    elapsed_s: float

    @property
    def expanded(self) -> list[str]:
        return list(self.episodes)

    @property
    def compile_calls_spent(self) -> int:
        return self.compile_calls_probe + self.compile_calls_expansion

    @property
    def compile_calls_unpruned_bound(self) -> int:
        """Every problem expanded into G episodes of max_turns turns, one compile per turn (no probe)."""
        return len(self.problems) * self.group * self.max_turns

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "seed": self.seed,
            "group": self.group,
            "max_turns": self.max_turns,
            "problems": self.problems,
            "n_probed": len(self.problems),
            "fraction_pruned": self.dcp.fraction_pruned,
            "dcp": self.dcp.to_dict(),
            "expanded": self.expanded,
            "probe_runs": self.probe_runs,
            "episodes": self.episodes,
            "compile_calls": {
                "probe": self.compile_calls_probe,
                "expansion": self.compile_calls_expansion,
                "spent": self.compile_calls_spent,
                "unpruned_bound": self.compile_calls_unpruned_bound,
            },
            "elapsed_s": self.elapsed_s,
        }

    def format(self) -> str:
        n = len(self.problems)
        lines = [
            f"LEAP expansion: agent {self.agent}, {n} problems probed (seed {self.seed}), G={self.group}, max_turns={self.max_turns}",
            f"pruned {len(self.dcp.pruned)}/{n} = {self.dcp.fraction_pruned:.1%}; expanded {len(self.episodes)}",
            f"compile calls spent: probe {self.compile_calls_probe} + expansion {self.compile_calls_expansion} = {self.compile_calls_spent}"
            f" (unpruned expansion: up to {self.compile_calls_unpruned_bound})",
            "",
            self.dcp.format(),
        ]
        if self.episodes:
            lines += ["", "episodes:"]
            for pid, eps in self.episodes.items():
                shown = ", ".join(f"{'correct' if e['correct'] else 'wrong'} r={e['reward']:.3g} t={e['turns']}" for e in eps)
                lines.append(f"  {pid}: {shown}")
        lines.append(f"({self.elapsed_s:.1f} s)")
        return "\n".join(lines)


def _episode_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run.get("run_id"),
        "trajectory_id": run.get("trajectory_id"),
        "turns": int(run.get("turns") or len(run.get("steps") or [])),
        "correct": bool(run.get("correct")),
        "reward": float(run.get("reward") or 0.0),
        "stop_reason": run.get("stop_reason"),
        "compile_calls": compile_calls(run),
    }


async def _expand(
    base_url: str,
    api_key: str | None,
    agent: str,
    items: list[int | str],
    G: int,
    max_turns: int,
    *,
    seed: int,
    sample_seed: int,
    p_hi: float,
    s_hi: float,
    concurrency: int,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None,
    admin: bool,
    model: str | None = None,
) -> tuple[dict[str, int], dict[str, list[dict[str, Any]]], PruneReport, dict[str, list[dict[str, Any]]]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits, transport=transport) as client:

        async def run(i: int | str, k: int, turns: int, group: str | None = None) -> dict[str, Any]:
            body: dict[str, Any] = {"task": TASK, **problem_ref(i), "seed": seed, "sample_seed": k, "max_turns": turns}
            if group is not None:
                body["group"] = group
            if model is not None:
                body["model"] = model
            async with sem:
                r = await client.post(f"/{'admin' if admin else 'v1'}/agents/{agent}/runs", json=body)
            if r.status_code != 200:
                raise RunFailed(f"run of problem {i} (sample_seed {k}) failed with {r.status_code}: {r.text[:500]}")
            out: dict[str, Any] = r.json()
            return out

        probe = await asyncio.gather(*(run(i, sample_seed + k, 1, PROBE_GROUP) for i in items for k in range(G)))
        problems: dict[str, int] = {}
        probe_runs: dict[str, list[dict[str, Any]]] = {}
        for n, i in enumerate(items):
            group = probe[n * G : (n + 1) * G]
            pid = str(group[0].get("problem_id"))
            if any(str(g.get("problem_id")) != pid for g in group) or group[0].get("task") != TASK:
                raise ProbeParseError(f"problem {i}: the probe runs are not one {TASK} problem: {[g.get('problem_id') for g in group]}")
            index = group[0].get("problem_index")
            if not isinstance(index, int) or any(g.get("problem_index") != index for g in group):
                raise ProbeParseError(f"problem {i}: the probe runs do not name one problem_index: {[g.get('problem_index') for g in group]}")
            if pid in problems:
                raise ValueError(f"problem {pid} given twice (indices {problems[pid]} and {index})")
            problems[pid], probe_runs[pid] = index, group
        report = prune({pid: [probe_sample(r) for r in runs] for pid, runs in probe_runs.items()}, max_turns=max_turns, p_hi=p_hi, s_hi=s_hi)
        kept = [(pid, problems[pid]) for pid in report.kept]
        done = await asyncio.gather(*(run(i, sample_seed + G + k, max_turns) for _, i in kept for k in range(G)))
        episodes = {pid: list(done[n * G : (n + 1) * G]) for n, (pid, _) in enumerate(kept)}
        return problems, probe_runs, report, episodes


def expand(
    base_url: str,
    api_key: str | None,
    agent: str,
    task_names_or_indices: Sequence[int | str],
    G: int,
    max_turns: int,
    *,
    seed: int = 0,
    sample_seed: int = 0,
    p_hi: float = 1.0,
    s_hi: float = 1.0,
    concurrency: int = 8,
    timeout_s: float = 900.0,
    probe_out: list[ProbeSample] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    admin: bool = False,
    model: str | None = None,
) -> ExpandReport:
    """Probe, prune and expand ``task_names_or_indices`` of the ``kernels`` task through ``agent`` (module docstring).

    ``max_turns`` is the expansion's turn cap (the agent's own: 4 for ``kernel-agent``). ``probe_out``, if given,
    receives every probe sample (for saving as a probe file that ``python -m learner.leap --probe`` reads);
    ``transport`` replaces httpx's network transport (tests). ``admin``: ``api_key`` is the runtime's admin key
    and the runs go through ``POST /admin/agents/{agent}/runs`` (the learner's runs; the admin key is refused on /v1);
    ``model`` (a ``family@N``) runs them on that policy instead of the agent's own model (the learner: its current weights).
    Raises :class:`RunFailed` on a server error and :class:`ProbeParseError` on a probe it cannot read."""
    if G < 1 or max_turns < 1:
        raise ValueError(f"need G >= 1 and max_turns >= 1, got G={G}, max_turns={max_turns}")
    items = list(task_names_or_indices)
    if len(set(items)) != len(items):
        raise ValueError(f"a problem is given twice: {items}")
    t0 = time.perf_counter()
    problems, probe_runs, report, episodes = asyncio.run(
        _expand(
            base_url,
            api_key,
            agent,
            items,
            G,
            max_turns,
            seed=seed,
            sample_seed=sample_seed,
            p_hi=p_hi,
            s_hi=s_hi,
            concurrency=concurrency,
            timeout_s=timeout_s,
            transport=transport,
            admin=admin,
            model=model,
        )
    )
    if probe_out is not None:
        probe_out.extend(probe_sample(r) for runs in probe_runs.values() for r in runs)
    out = ExpandReport(
        agent=agent,
        seed=seed,
        group=G,
        max_turns=max_turns,
        problems=problems,
        dcp=report,
        probe_runs={pid: [str(r.get("run_id")) for r in runs] for pid, runs in probe_runs.items()},
        episodes={pid: [_episode_summary(r) for r in runs] for pid, runs in episodes.items()},
        compile_calls_probe=sum(compile_calls(r) for runs in probe_runs.values() for r in runs),
        compile_calls_expansion=sum(compile_calls(r) for runs in episodes.values() for r in runs),
        elapsed_s=time.perf_counter() - t0,
    )
    log.info(
        "leap.expand",
        agent=agent,
        probed=len(problems),
        pruned=len(report.pruned),
        fraction_pruned=round(report.fraction_pruned, 4),
        expanded=len(episodes),
        episodes=sum(len(v) for v in episodes.values()),
        compile_calls_spent=out.compile_calls_spent,
        compile_calls_unpruned_bound=out.compile_calls_unpruned_bound,
    )
    return out


def run_cli(args: argparse.Namespace) -> int:
    """``python -m learner.leap --expand ...`` (the arguments are parsed by ``learner.leap.main``)."""
    try:
        items = parse_problems(args.problems)
    except ValueError as exc:
        print(f"error: --problems: {exc}", file=sys.stderr)
        return 2
    samples: list[ProbeSample] = []
    try:
        report = expand(
            args.url,
            args.api_key,
            args.agent,
            items,
            args.group,
            args.max_turns,
            seed=args.seed,
            sample_seed=args.sample_seed,
            p_hi=args.p_hi,
            s_hi=args.s_hi,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            probe_out=samples,
        )
    except httpx.ConnectError as exc:
        print(f"error: no loopwise server at {args.url} ({exc})", file=sys.stderr)
        return 2
    except (ValueError, RunFailed, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.save_probe is not None:
        Path(args.save_probe).write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0
