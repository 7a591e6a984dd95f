"""Shared pieces of the learning benchmarks (``patr_compare.py``, ``rods_compare.py``, ``rtpo_compare.py``,
``trl_compare.py``, ``svr_reves.py``): the server they start, the base model's held-out evaluation, rollouts,
updates, held-out evals of trained versions, bootstrap CIs and the JSON they write.

The loopwise side of a benchmark is the real product path: a spawned ``serve.py`` (:func:`bench_server`) serves
the model and the agents, rollouts are ``POST /v1/agents/{agent}/runs`` (recorded with exact ids and verifier
rewards), and updates are the learner's own ``LearnerService.update`` (sample collection, estimator,
re-rollouts, trainer step, publish, load). Only the promotion policy differs: :class:`PromoteService`
serves every new version at once (alias flip), without the eval gate or an A/B experiment, so a
benchmark measures the estimator, not the gate. Held-out evaluations (:func:`base_heldout`,
:func:`final_heldout`, :func:`heldout_results`) run the same problems and sampling seeds for every model.

Not a test and not part of the product; what each benchmark trains, measures and reports is its own.
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from experiments.agent_eval import spawned_server
from learner.config import LearnerSettings
from learner.release import Release
from learner.rollout_steps import RolloutSteps
from learner.runs_client import post_runs
from learner.scheduler import Scheduler
from learner.service import LearnerService, ServiceConfig
from learner.update import Trainer

ROOT = Path(__file__).resolve().parent.parent


class PromoteRelease(Release):
    """The learner's release job with 'always serve the newest version': published through the learner's one publish
    path, then the family's alias flips to it (no eval gate, no A/B experiment)."""

    def publish_and_gate(self, trainer: Trainer) -> dict[str, Any]:
        new = self.publish_current(trainer, meta={"metrics": self.state.status.last_metrics})
        self.state.admin.set_alias(self.state.family, new)
        self.state.status.champion = new
        return {"decision": "promoted", "new": new}


class PromoteService(LearnerService):
    """The learner with :class:`PromoteRelease` instead of the eval gate and A/B: every job that releases (the update,
    the RTPO sweep's steps, the scheduler) gets it."""

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.release = PromoteRelease(self.state)
        self.steps = RolloutSteps(self.state, self.release)
        self.scheduler = Scheduler(self.state, self.release)

    def serve_newest(self) -> str | None:
        """On a resumed run: the family's newest published version loaded and its alias on it (what the run served before
        the cut; a server from before its store kept the registry restarted without it, and the runs sampled the base,
        which the learner then skipped as stale); its name, None before the first version."""
        version = self.state.published_version()
        if version == 0:
            return None
        name = self.state.ensure_loaded(version)
        if self.state.champion() != name:
            self.state.admin.set_alias(self.state.family, name)
        self.state.status.champion = name
        return name


class BenchServer(NamedTuple):
    """A spawned ``serve.py``, as a learning benchmark uses it."""

    url: str
    key: str  # its admin key (a fresh one per run)
    data: Path  # its data folder: the interaction store the benchmark's learners read
    model_path: Path  # the base model's files, which the learners' trainers load
    base: str  # the name the base model is served under


def served_model(url: str) -> str:
    """The name the server serves its base model under (``GET /ready``)."""
    return str(httpx.get(url + "/ready", timeout=30).json()["model"])


@contextmanager
def bench_server(
    model: str, out: Path, max_adapters: int = 12, resume: bool = False, flags: list[str] | None = None, key: str | None = None
) -> Iterator[BenchServer]:
    """Empties ``out`` (what a previous run left there is removed; with ``resume``, kept: the server reopens its store,
    registry and adapters), then spawns ``serve.py`` for ``model`` with its data folder ``out/server``, the admin
    ``key`` (default a fresh one), room for ``max_adapters`` loaded adapter versions and ``flags``; stopped on exit."""
    if not resume:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    key = key or secrets.token_hex(8)
    data = out / "server"
    with spawned_server(model, key, ["--max-loaded-adapters", str(max_adapters), *(flags or [])], data_dir=data) as url:
        model_path = data / "models" / ("SmolLM2-135M-Instruct" if model == "default" else model)
        yield BenchServer(url, key, data, model_path, served_model(url))


def service(url: str, key: str, data: Path, model_path: Path, agent: str, settings: dict[str, Any]) -> PromoteService:
    cfg = ServiceConfig(
        data_dir=data,
        admin_url=url,
        admin_key=key,
        base_model=model_path,
        settings=LearnerSettings.model_validate(settings),
        agent=agent,
        gate_n=0,
    )
    return PromoteService(cfg)


def admin(url: str, key: str, method: str, path: str, **kw: Any) -> dict[str, Any]:
    r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {key}"}, timeout=300, **kw)
    if r.status_code >= 400:
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
    return r.json()


def add_agent(url: str, key: str, config: dict[str, Any]) -> None:
    names = {a["name"] for a in admin(url, key, "GET", "/admin/agents")["data"]}
    if config["name"] not in names:
        admin(url, key, "POST", "/admin/agents", json=config)


def agent_runs(url: str, agent: str, bodies: list[dict[str, Any]], concurrency: int = 16, admin_key: str | None = None) -> list[dict[str, Any]]:
    """Each body posted to the agent's runs endpoint (``/v1/agents/{agent}/runs``; with ``admin_key``, the admin one),
    ``concurrency`` at a time (``learner.runs_client``); the runs in the order of ``bodies``. A failed run stops the
    benchmark."""
    outs = post_runs(url, admin_key, agent, bodies, concurrency=concurrency, timeout_s=1800.0, admin=admin_key is not None)
    failed = [o for o in outs if isinstance(o, str)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outs)} runs of {agent} failed; the first: {failed[0]}")
    return [o for o in outs if not isinstance(o, str)]


def rollouts(url: str, agent: str, task: str, problems: list[int], group: int, seed: int, concurrency: int = 16) -> list[dict[str, Any]]:
    """``group`` sampled runs per training problem (problem seed 0), recorded with their verifier rewards."""
    bodies = [{"task": task, "problem_index": p, "seed": 0, "sample_seed": seed * 100_003 + p * 131 + k} for p in problems for k in range(group)]
    runs = agent_runs(url, agent, bodies, concurrency)
    time.sleep(0.5)  # the recorder commits every 50 ms: let the last turns and rewards land before an update reads them
    return runs


def heldout(url: str, agent: str, task: str, n: int, model: str, seed: int = 4242, concurrency: int = 16) -> float:
    """Success rate on ``n`` held-out problems (a problem seed no training run uses), as eval runs."""
    results = heldout_results(url, agent, task, n, model, seed, concurrency)
    return sum(results) / n


def heldout_results(url: str, agent: str, task: str, n: int, model: str, seed: int = 4242, concurrency: int = 16) -> list[bool]:
    """Per held-out problem ``0..n-1`` (same problems and sampling seeds for every model): did the eval run succeed."""
    bodies = [{"task": task, "problem_index": i, "seed": seed, "sample_seed": i, "model": model, "eval": True} for i in range(n)]
    runs = agent_runs(url, agent, bodies, concurrency)
    return [bool(r.get("correct")) for r in runs]


def base_heldout(server: BenchServer, eval_agent: dict[str, Any], task: str, n: int) -> list[bool]:
    """Adds the evaluation agent ``eval_agent`` (a config without an adapter family) and evaluates the base model with it
    on the ``n`` held-out problems: per problem, did it succeed (:func:`heldout_results`)."""
    add_agent(server.url, server.key, eval_agent)
    return heldout_results(server.url, eval_agent["name"], task, n, server.base)


def final_heldout(server: BenchServer, eval_agent: str, task: str, n: int, arm: dict[str, Any]) -> None:
    """Evaluates an arm's final version (``arm["final"]``; the base model when it published none) on the ``n`` held-out
    problems: sets ``arm["heldout_runs"]`` (per problem) and ``arm["heldout"]`` (the success rate) and prints them."""
    model = arm["final"] or server.base
    arm["heldout_runs"] = heldout_results(server.url, eval_agent, task, n, model)
    arm["heldout"] = sum(arm["heldout_runs"]) / len(arm["heldout_runs"])
    print(f"  held-out success {arm['heldout']:.3f} ({model}), {arm['wall_s']:.0f} s", flush=True)


def bootstrap_ci(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


class HeldoutBootstrap:
    """Held-out success of benchmark arms over seeds x problems (``by[arm][seed]`` = one bool per held-out problem, the
    same problems and sampling seeds for every arm): a point estimate and a 95% percentile-bootstrap CI, seeds and
    problems resampled together; differences are paired by seed and problem. One RNG across calls (reproducible)."""

    def __init__(self, by: dict[str, dict[int, list[bool]]], seeds: list[int], n: int, reps: int = 4000, seed: int = 0) -> None:
        self.by, self.seeds, self.n, self.reps = by, seeds, n, reps
        self._rng = random.Random(seed)

    def mean(self, arm: str) -> Any:
        return lambda ss, ps: sum(self.by[arm][s][p] for s in ss for p in ps) / (len(ss) * len(ps))

    def ci(self, stat: Any) -> tuple[float, float, float]:
        rng, seeds, n, reps = self._rng, self.seeds, self.n, self.reps
        point = stat(seeds, list(range(n)))
        draws = sorted(stat([rng.choice(seeds) for _ in seeds], [rng.randrange(n) for _ in range(n)]) for _ in range(reps))
        return point, draws[int(0.025 * reps)], draws[int(0.975 * reps) - 1]

    def arm(self, arm: str) -> tuple[float, float, float]:
        return self.ci(self.mean(arm))

    def diff(self, arm: str, other: str) -> tuple[float, float, float]:
        a, b = self.mean(arm), self.mean(other)
        return self.ci(lambda ss, ps: a(ss, ps) - b(ss, ps))


def resumed_run(results: Path, design: dict[str, str], resume: bool) -> dict[str, Any]:
    """What a ``--resume`` run continues: ``results`` as written so far (``{}`` without ``resume`` or the file); exits
    naming the settings that differ when it was run with another ``design``."""
    done: dict[str, Any] = json.loads(results.read_text()) if resume and results.exists() else {}
    # a key the design no longer holds (a setting that became a choice of which arms run now) is not compared
    stored = {k: v for k, v in done.get("design", {}).items() if k in design}
    if done and stored != design:
        changed = sorted(k for k in design if stored.get(k) != design[k])
        raise SystemExit(f"--resume: {results} was run with another design (differs in {', '.join(changed)}); fix the design or start anew")
    return done


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str))
