"""The learner process for one adapter family: wait for data → train → publish → load → gate → A/B.

``python -m learner run`` runs :class:`LearnerService`. It reads the interaction store (the same
SQLite file the server writes) and talks to the runtime only over its admin API and the adapter
folder, so it can run on another host that shares the data folder.

One update:
1. **Wait** until ``min_new_trajectories`` new rewarded trajectories of the agent arrived (evaluation
   runs excluded), or an update is requested (``POST /admin/learner/update`` writes a request file).
   While the family has a running A/B experiment, updates keep training (on both arms' traffic, within
   the staleness bound) but publish nothing: the trained version is held and published, gated and
   put against the champion as soon as the experiment has decided (asynchronous training, as AReaL
   does; an experiment that waits for evidence no longer stalls learning).
2. **Train**: the settled samples past the data cursor (``learner.samples``) → one ``LoRATrainer.step``
   (advantages from the configured estimator; a batch of zero-variance groups skips the optimizer step
   but still advances the version). A checkpoint (weights, optimizer, RNG, version, cursor) is written
   atomically after every update, so a killed learner resumes where it stopped.
3. **Publish** ``family@N`` (staging → hashes → manifest last → rename) and load it into the runtime.
4. **Gate**: the agent runs ``gate_n`` held-out problems of its task on the new version and on the
   champion (the family alias, or the base model before the first version) through the runs endpoint
   (``"eval": true``, so the learner never trains on them). A version that regresses by more than
   ``gate_tolerance`` is unloaded.
5. **A/B**: the first passing version becomes the champion (alias set); later ones enter an experiment
   against the champion with auto-promote and auto-rollback on the task's verifier reward (without an agent
   task, as for chat traffic: on the users' ``feedback``).
6. **Rejected lines are not descended**: a version refused by the gate or the parity probe, or rolled back by
   its experiment, makes the next update start from the champion's weights with a fresh optimizer
   (``restart_from_champion``).

State for people: ``<data-dir>/learner/<family>/status.json`` (served by ``GET /admin/learner``),
``history.jsonl`` (one line per update) and ``reward.png`` (reward per update).

Not here: how samples, steps and publishing work (``samples``, ``trainer``, ``publish``).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from learner.adapter_manifest import manifest_sha256
from learner.advantages import Advantages
from learner.baseline import GROUP_ESTIMATORS, apply_to_singletons
from learner.config import LearnerSettings, TrafficFilter
from learner.publish import AdminError, RuntimeAdmin, adapter_path, clean_staging, publish_adapter
from learner.reasons import unused_reasons
from learner.records import Trajectory
from learner.rerollout import BranchRunner, PointRuns, counterfactual_scores, plan_rtpo, refresh_point, rtpo_estimator_input, tcpo_branch_points
from learner.samples import Cursor, Sample, SkipCounts, collect_samples, traffic_match, trajectory_samples
from learner.store import db_path, open_store
from learner.svr_rewards import apply_self_check_rewards
from learner.svr_rollouts import adaptive_report, fixed_horizon_runs
from learner.update import checkpoint_and_publish, estimate

log = structlog.get_logger(__name__)

REQUEST_FILE = "update.request"
RESTART_FILE = "restart.request"  # a version was rejected: the next update starts from the champion (survives a learner restart)
INTERMEDIATE = "rtpo_intermediate"  # manifest key of versions published only for an RTPO sweep's siblings
UPDATE_VERSIONS = "update_versions"  # trainer.cursor key: the final version of each recent update (the staleness bound)
LEAP_NEXT = "leap_next_problem"  # trainer.cursor key: the next problem index LEAP's data engine probes
SVR_NEXT = "svr_next_problem"  # trainer.cursor key: the next training problem of SVR's fixed-horizon runs
REVES_NEXT = "reves_next_item"  # trainer.cursor key: the next training item REVES augments
BASELINE = "singleton_baseline"  # trainer.cursor key: the running baselines of one-off prompts (learner/baseline.py)


class LearnerConfigError(ValueError):
    """The learner's settings cannot work with this runtime (e.g. re-rollouts for an agent without a task)."""


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Have Linux send ``sig`` to this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``); False where unsupported.

    For the learner serve.py starts: a server killed without its ``finally`` (SIGKILL, or SIGTERM re-raised
    by uvicorn) otherwise leaves a learner training on, model in memory, until its step ends. The learner's
    SIGTERM handler then abandons the round it is in (safe: checkpoints and publishes are written to a
    temporary folder and renamed) or, idle, stops at once."""
    if not sys.platform.startswith("linux"):
        return False
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if os.getppid() != parent:  # the parent exited before the call
        os.kill(os.getpid(), sig)
    return True


def learner_dir(data_dir: Path, family: str) -> Path:
    return Path(data_dir) / "learner" / family


@dataclass
class ServiceConfig:
    data_dir: Path
    admin_url: str
    admin_key: str
    base_model: Path
    settings: LearnerSettings
    agent: str | None = None  # the agent whose runs train the family (and that the gate evaluates)
    task: str | None = None  # the gate's task (default: the agent's)
    adapter_root: Path | None = None  # default <data-dir>/adapters (the runtime's default)
    min_new_trajectories: int = 32
    poll_s: float = 10.0
    gate_n: int = 32
    gate_seed: int = 100_000  # held-out problems: a seed the live traffic and demo never use
    gate_tolerance: float = 0.05
    ab_min_samples: int = 64
    ab_max_samples: int | None = 256  # an undecided experiment ends here (the champion stays), so training goes on being published
    store: str | None = None  # the interaction store's URL or file (default <data-dir>/interactions.db)


@dataclass
class Status:
    family: str
    state: str = "idle"  # idle | waiting | expanding | completing | training | publishing | probing | gating | ab | stopped | error
    detail: str = ""
    version: int = 0  # the latest version trained
    champion: str | None = None
    experiment: str | None = None
    new_trajectories: int = 0
    updates: int = 0
    last_update_at: float | None = None
    last_metrics: dict[str, Any] = field(default_factory=dict)
    last_gate: dict[str, Any] = field(default_factory=dict)
    last_reasons: dict[str, Any] = field(default_factory=dict)  # what the last update could not use, and why (learner/reasons.py)
    last_parity: dict[str, Any] = field(default_factory=dict)  # the parity probe of the last loaded version (learner/parity.py)
    challenger: str | None = None  # the version in the running experiment
    restarts: int = 0  # times the trainer restarted from the champion after a rejected version
    traffic: dict[str, Any] = field(default_factory=dict)  # the traffic filter this learner trains on
    pid: int = field(default_factory=os.getpid)
    updated_at: float = field(default_factory=time.time)


class LearnerService:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.family = cfg.settings.family
        self.dir = learner_dir(cfg.data_dir, self.family)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.adapter_root = cfg.adapter_root or Path(cfg.data_dir) / "adapters"
        self.store = open_store(cfg.store or db_path(cfg.data_dir))
        self.admin = RuntimeAdmin(cfg.admin_url, cfg.admin_key)
        s = cfg.settings.traffic
        # --agent names the one agent this learner trains (and gates) on; otherwise the [traffic] table decides
        self.traffic = TrafficFilter(chat=False, agents=[cfg.agent], models=s.models, tags=s.tags) if cfg.agent else s
        self.status = Status(self.family, traffic=self.traffic.model_dump())
        self._restart = (self.dir / RESTART_FILE).exists()  # a version was rejected: the next update starts from the champion's weights
        self._rejected_names: set[str] = set()  # versions refused or rolled back: never used for re-rollouts
        self._trained: list[Sample] = []  # the last update's samples (the parity probe picks its turns among them)
        self._baseline_state: dict[str, Any] | None = None  # the singleton baselines after this update's step
        self._warmup: set[str] = set()
        self._trainer: Any = None  # built on the first update: idle learners hold no model
        self._held = False  # a version trained during an experiment waits to be published
        self._stop = False
        self._busy = False  # inside a scheduling round (an update, a publish, a gate)
        self._seen_since = time.time()
        self._checked = False
        # set by serve.py: the learner stops when its server does (uvicorn re-raises SIGTERM, so the server cannot always stop it)
        parent = os.environ.get("LOOPWISE_LEARNER_PARENT")
        self._parent = int(parent) if parent and parent.isdigit() and int(parent) == os.getppid() else None

    # ---- the loop ------------------------------------------------------------------------------
    def run_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._parent is not None:
            die_with_parent(self._parent)  # SIGTERM when the server dies: the polling in _sleep only notices between rounds
        removed = clean_staging(self.adapter_root)
        if removed:
            log.info("removed half-published adapters", paths=[str(p) for p in removed])
        self._restore_cursor()
        try:
            self.check_setup()
        except LearnerConfigError as exc:
            self._set("error", str(exc))
            raise
        except (AdminError, httpx.HTTPError):  # the runtime is not up yet: checked again before the first update
            pass
        while not self._stop:
            try:
                self._busy = True
                self.tick()
            except (AdminError, httpx.HTTPError) as exc:  # the runtime is away (restarting?): retry next round
                self._set("error", f"runtime admin API: {exc}")
                log.warning("learner round failed", error=str(exc))
            finally:
                self._busy = False
            self._sleep(self.cfg.poll_s)
        self._set("stopped", "")
        self.admin.close()
        self.store.close()

    def stop(self) -> None:
        self._stop = True

    def _on_sigterm(self, *_: Any) -> None:
        """Stop after this round; orphaned mid-round (the server died), abandon it: checkpoints and publishes are atomic."""
        self.stop()
        if self._busy and self._parent is not None and os.getppid() != self._parent:
            raise SystemExit(143)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop and time.monotonic() < end and not (self.dir / REQUEST_FILE).exists():
            if self._parent is not None and os.getppid() != self._parent:
                log.info("the server that started this learner is gone; stopping", parent=self._parent)
                self.stop()
                break
            time.sleep(min(0.5, seconds))

    def tick(self) -> bool:
        """One scheduling round; returns whether an update ran."""
        requested = (self.dir / REQUEST_FILE).exists()
        if requested:
            (self.dir / REQUEST_FILE).unlink(missing_ok=True)
        running = self.status.experiment is not None and self._experiment_running(self.status.experiment)
        if not running and self._held:
            self._publish_held()
            return True
        self.status.new_trajectories = self._count_new()
        if not requested and self.status.new_trajectories < self.cfg.min_new_trajectories:
            wait = f"{self.status.new_trajectories}/{self.cfg.min_new_trajectories} new rewarded trajectories"
            if running:
                self._set("ab", f"experiment {self.status.experiment} running; {wait} for the next update")
            else:
                self._set("waiting", wait)
            return False
        record = self.update(force=requested, publish=not running)
        return bool(record["metrics"])

    # ---- one update ----------------------------------------------------------------------------
    def check_setup(self) -> None:
        """Refuse a configuration that cannot work, before any model is loaded (raises :class:`LearnerConfigError`).

        RTPO's and TCPO's re-rollouts replay task runs through the agent's runs endpoint and need its verifier:
        they need the learner's agent and that agent's task. LEAP's data engine needs the agent. (TCPO itself
        trains wherever rewards exist: without per-turn scores it falls back to the outcome.)"""
        if self._checked:
            return
        s = self.cfg.settings
        needs_task = s.rerollouts.enabled and s.trainer.estimator in ("rtpo", "tcpo")
        svr_runs = s.svr.enabled and s.svr.problems_per_update > 0
        engine = "[leap]" if s.leap.enabled else "[svr] runs" if svr_runs else "[reves]" if s.reves.enabled else None
        if (needs_task or engine) and self.cfg.agent is None:
            what = f"estimator {s.trainer.estimator!r} with re-rollouts" if needs_task else f"{engine} enabled"
            raise LearnerConfigError(f"{what} needs the learner's agent (--agent): its runs are what is replayed or expanded")
        sc = s.singletons
        if sc.mode == "complete" and sc.scorer == "hook" and sc.hook and not sc.hook.startswith(("http://", "https://")):
            from learner.group_completion import load_hook

            try:
                load_hook(sc.hook)
            except (ImportError, ValueError) as exc:
                raise LearnerConfigError(f"[singletons] hook {sc.hook!r} cannot be loaded: {exc}") from exc
        if needs_task and self._task() is None:
            raise LearnerConfigError(
                f"estimator {s.trainer.estimator!r} re-rolls task runs scored by a verifier, but agent {self.cfg.agent!r} has no task: "
                "give the agent a task, or set [rerollouts] enabled = false"
            )
        self._checked = True

    def update(self, force: bool = True, publish: bool = True) -> dict[str, Any]:
        """One update; with ``force=False`` nothing happens (no version) when no sample is ready.

        With ``publish=False`` (an experiment is running) a trained version is held: checkpointed, not
        published; ``tick`` publishes the newest held version once the experiment has decided."""
        self.check_setup()
        trainer = self._get_trainer()
        if self._restart:
            self._restart_from_champion(trainer)
        leap = self._leap_expand(trainer) if self.cfg.settings.leap.enabled else None
        svr_runs = self._svr_runs(trainer) if self.cfg.settings.svr.enabled and self.cfg.settings.svr.problems_per_update else None
        reves = self._reves_round(trainer) if self.cfg.settings.reves.enabled else None
        self._await_recorded([*(svr_runs or {}).pop("trajectory_ids", []), *(reves or {}).pop("trajectory_ids", [])])
        self._set("training", f"version {trainer.version + 1}")
        batch = collect_samples(
            self.store,
            family=self.family,
            min_version=self._staleness_floor(trainer),
            cursor=Cursor.from_dict(trainer.cursor),
            cfg=self.cfg.settings.samples,
            traffic=self.traffic,
        )
        samples = batch.samples
        skipped = batch.counts.as_dict()
        samples, self_check_rewards = apply_self_check_rewards(samples, self.cfg.settings.svr, self.cfg.settings.svr_r1)
        skipped["svr_adaptive"], skipped["self_check_unmeasured"] = self_check_rewards["adaptive"], self_check_rewards["unmeasured"]
        if not samples and not force:
            why = unused_reasons(skipped, [], [])
            self.status.last_reasons = why
            self._set("waiting", f"no settled samples yet: {why['top'] or 'no rewarded trajectories'}")
            return {"version": trainer.version, "at": time.time(), "metrics": {}, "gate": {"decision": "skipped", "reason": "no samples"}}
        self._baseline_state, self._warmup = None, set()
        metrics, rerollouts, advantages, used = self._train(trainer, samples, skipped)
        self._trained = used
        why = unused_reasons(skipped, used, advantages, warmup=self._warmup) | {"trained": metrics.trained_samples}
        keep = self.cfg.settings.samples.max_staleness + 1
        leap_next = int(trainer.cursor.get(LEAP_NEXT, 0)) + (self.cfg.settings.leap.problems_per_update if leap is not None else 0)
        svr_next = int(svr_runs["problems"][1]) if svr_runs is not None else int(trainer.cursor.get(SVR_NEXT, 0))
        reves_next = int(reves["items"][1]) if reves is not None else int(trainer.cursor.get(REVES_NEXT, 0))
        baseline = self._baseline_state if self._baseline_state is not None else trainer.cursor.get(BASELINE, {})
        trainer.cursor = {
            **batch.cursor.to_dict(),
            UPDATE_VERSIONS: [*_update_versions(trainer), trainer.version][-keep:],
            LEAP_NEXT: leap_next,
            SVR_NEXT: svr_next,
            REVES_NEXT: reves_next,
            BASELINE: baseline,
        }
        self._seen_since = batch.cursor.since
        trainer.save_checkpoint(self.dir / "checkpoints")
        record: dict[str, Any] = {"version": trainer.version, "at": time.time(), "metrics": metrics.as_dict(), "unused": why}
        self.status.last_reasons = why
        if why["top"]:
            log.info("unused data", top_reason=why["top"], trained=why["trained"], **why["counts"])
        if rerollouts is not None:
            record["group_completion" if "completed_groups" in rerollouts or "group_completion" in rerollouts else "rerollouts"] = rerollouts
        if leap is not None:
            record["leap"] = leap
        if svr_runs is not None:
            record["svr_runs"] = svr_runs
        if reves is not None:
            record["reves"] = reves
        if self.cfg.settings.svr.enabled or self.cfg.settings.svr_r1.enabled:
            record["self_check_rewards"] = self_check_rewards
        self.status.version, self.status.updates, self.status.last_update_at = trainer.version, self.status.updates + 1, time.time()
        self.status.last_metrics = metrics.as_dict()
        if metrics.optimizer_step and publish:
            self._held = False
            record["gate"] = self._publish_and_gate(trainer)
        elif metrics.optimizer_step:
            self._held = True
            record["gate"] = {"decision": "held", "reason": f"experiment {self.status.experiment} is running: published once it decides"}
            self._set("ab", f"version {trainer.version} trained, held until experiment {self.status.experiment} decides")
        else:
            reason = why["top"] or "no samples"
            record["gate"] = {"decision": "skipped", "reason": f"no optimizer step: {reason}"}
            self._set("idle", f"version {trainer.version}: nothing learned; top reason: {reason}")
        with open(self.dir / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self._plot()
        return record

    def _publish_held(self) -> None:
        """Publish and gate the version trained while an experiment ran (one history line, no new metrics)."""
        trainer = self._get_trainer()
        self._held = False
        record: dict[str, Any] = {"version": trainer.version, "at": time.time(), "metrics": {}, "held": True}
        record["gate"] = self._publish_and_gate(trainer)
        with open(self.dir / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self._plot()

    # ---- training: samples → advantages (estimator) → trainer step, with re-rollouts for rtpo / tcpo ---
    def _train(self, trainer: Any, samples: list[Sample], skipped: dict[str, int]) -> tuple[Any, dict[str, Any] | None, list[float], list[Sample]]:
        """One update's optimizer work: advantages from the configured estimator, then the trainer's step; RTPO
        sweeps its turns in reverse with siblings, TCPO first scores counterfactuals (``learner/rerollout.py`` plans both).
        One-off prompts (singleton groups) get the running baseline (``learner/baseline.py``) when ``[singletons]`` says so.

        Returns the step's metrics, the re-rollouts' report, and the advantages with the samples they belong to (for
        ``learner/reasons.py``; none for RTPO's and TCPO's several steps)."""
        rr = self.cfg.settings.rerollouts
        tcfg = self.cfg.settings.trainer
        if samples and rr.enabled and self.cfg.agent is not None and tcfg.estimator in ("rtpo", "tcpo"):
            runner = BranchRunner(self.cfg.admin_url, self.cfg.admin_key, agent=self.cfg.agent, store=self.store, concurrency=rr.concurrency)
            if tcfg.estimator == "rtpo":
                m, info = self._rtpo_sweep(trainer, runner, samples, skipped)
            else:
                m, info = self._tcpo_step(trainer, runner, samples, skipped)
            return m, info, [], []  # several steps' advantages: the reasons count the sample builder's losses only
        sc = self.cfg.settings.singletons
        info: dict[str, Any] | None = None
        if sc.mode == "complete" and tcfg.estimator in GROUP_ESTIMATORS:
            samples, info = self._complete_groups(trainer, samples)
        advantages = estimate(samples, tcfg.estimator, tcfg.estimator_params)
        if sc.mode in ("baseline", "complete") and tcfg.estimator in GROUP_ESTIMATORS:  # "complete": what it did not complete
            advantages, self._baseline_state, self._warmup = apply_to_singletons(
                samples, advantages, trainer.cursor.get(BASELINE), decay=sc.baseline_decay, norm_by_std=sc.baseline_norm_by_std
            )
        return trainer.step(samples, advantages, skipped=skipped), info, list(advantages), samples

    def _complete_groups(self, trainer: Any, samples: list[Sample]) -> tuple[list[Sample], dict[str, Any]]:
        """Group completion (``learner/group_completion.py``): the one-off one-turn trajectories' samples are replaced by
        their completed groups (the original and ``group_size - 1`` siblings sampled by the newest policy, all scored by
        the configured hook or judge)."""
        from learner.group_completion import GroupCompleter

        sc = self.cfg.settings.singletons
        candidates = GroupCompleter.candidates(samples)
        if not candidates:
            return samples, {"group_completion": "no one-off turns"}
        self._set("completing", f"group completion: {min(len(candidates), sc.max_turns_per_update)} one-off turns x {sc.group_size - 1} siblings")
        model = self._rollout_model()

        async def run() -> Any:
            headers = {"Authorization": f"Bearer {self.cfg.admin_key}"}
            async with httpx.AsyncClient(base_url=self.cfg.admin_url, headers=headers, timeout=sc.timeout_s) as client:
                completer = GroupCompleter(client, self.store, cfg=sc, family=self.family, samples_cfg=self.cfg.settings.samples)
                return await completer.complete(candidates, model=model, seed=trainer.version + 1)

        report = asyncio.run(run())
        done = set(report.completed)
        info = {"model": model, **report.as_dict()}
        log.info("group completion", **info)
        return [s for s in samples if s.trajectory_id not in done] + report.samples, info

    def _rtpo_sweep(self, trainer: Any, runner: BranchRunner, samples: list[Sample], skipped: dict[str, int]) -> tuple[Any, dict[str, Any]]:
        """RTPO (``docs/methods.md#rtpo``): K branch turns per backbone, m siblings each, optimizer steps latest turns first.

        Before each step, the siblings of its branch points and a refresh of each backbone's own continuation
        are sampled from the exact stored contexts by the newest policy (``refresh``: each step is checkpointed,
        then published as an intermediate ``family@N`` before the next step's re-rollouts). A sibling, and the
        backbone turn it is compared with, are scored by their whole continuation's return; every other turn
        gets trajectory GRPO. Without a branch point the sweep is one step: trajectory GRPO."""
        rr = self.cfg.settings.rerollouts
        params = self.cfg.settings.trainer.estimator_params
        rng = random.Random(f"{trainer.cfg.seed}:{trainer.version}")
        backbones = [t for tid in dict.fromkeys(s.trajectory_id for s in samples) if (t := self.store.get_trajectory(tid)) is not None]
        plan = plan_rtpo(backbones, [s.turn_index for s in samples], branches=rr.branches, bucket_size=rr.bucket_size, rng=rng)
        model = self._rollout_model()
        info: dict[str, Any] = {"estimator": "rtpo", "backbones": len(backbones), "branch_points": len(plan.points), "sibling_runs": 0}
        info.update(refresh_runs=0, failed=0, siblings=0, sampled_tokens=0, steps=[], refreshed=[])

        def to_samples(traj: Trajectory) -> list[Sample]:  # branches are fresh by construction: no staleness floor
            return trajectory_samples(traj, family=self.family, min_version=0, cfg=self.cfg.settings.samples, counts=SkipCounts())

        merged: Any = None
        published_here: list[str] = []
        for k, turns in enumerate(plan.segments):
            points = [p for p in plan.points if p.turn in turns]
            point_runs = [PointRuns(p) for p in points]
            if points:
                refresh = [(i, q) for i, p in enumerate(points) if (q := refresh_point(p)) is not None]
                sib = runner.run(points, n=rr.siblings, model=model, kind="rtpo", seed=trainer.version * 131 + k)
                seed = trainer.version * 131 + k
                ref = runner.run([q for _, q in refresh], n=1, model=model, kind="rtpo_refresh", seed=seed + 7) if refresh else []
                for r in sib:
                    if r.trajectory is not None:
                        point_runs[points.index(r.point)].siblings.append(r.trajectory)
                for (i, _), r in zip(refresh, ref, strict=True):
                    point_runs[i].refresh = r.trajectory
                runs = [*sib, *ref]
                info["sibling_runs"] += len(sib)
                info["refresh_runs"] += len(ref)
                info["failed"] += sum(1 for r in runs if r.error)
                info["sampled_tokens"] += sum(len(t.output_ids) for r in runs if r.trajectory is not None for t in r.trajectory.turns)
            est_in, train_idx = rtpo_estimator_input(samples, point_runs, set(turns), to_samples, self.cfg.settings.samples.reward_sources)
            advantages = estimate(est_in, "rtpo", params)
            chosen = [est_in[i] for i in train_idx]
            m = trainer.step(chosen, Advantages([advantages[i] for i in train_idx], advantages.stats), skipped=skipped if k == 0 else {})
            n_sib = sum(len(pr.siblings) for pr in point_runs)
            info["siblings"] += n_sib
            info["steps"].append({"turns": turns, "samples": len(chosen), "siblings": n_sib, "optimizer_step": m.optimizer_step})
            merged = _merge_metrics(merged, m)
            if rr.refresh and m.optimizer_step and k + 1 < len(plan.segments):
                model = self._publish_intermediate(trainer)  # the next step's re-rollouts continue with this policy
                published_here.append(model)
                info["refreshed"].append(model)
        for name in published_here:
            self._unload(name)  # intermediate versions served only this sweep's re-rollouts; the final one is published and gated next
        log.info("rtpo sweep", **{k: v for k, v in info.items() if k != "steps"})
        return merged, info

    def _tcpo_step(self, trainer: Any, runner: BranchRunner, samples: list[Sample], skipped: dict[str, int]) -> tuple[Any, dict[str, Any]]:
        """TCPO (``docs/methods.md``): M one-step alternatives from the exact history of each high-surprisal turn, scored by the verifier."""
        rr = self.cfg.settings.rerollouts
        chosen, points = tcpo_branch_points(samples, self.store, top_q=rr.cf_top_q, threshold=rr.cf_threshold)
        runs = runner.run(points, n=rr.cf_samples, model=self._rollout_model(), kind="tcpo", one_step=True, seed=trainer.version) if points else []
        scores = counterfactual_scores(runs)
        info = {
            "estimator": "tcpo",
            "selected_turns": len(chosen),
            "branch_points": len(points),
            "counterfactual_runs": len(runs),
            "failed": sum(1 for r in runs if r.error),
            "scored_turns": len(scores),
            "sampled_tokens": sum(len(t.output_ids) for r in runs if r.trajectory is not None for t in r.trajectory.turns),
        }
        log.info("tcpo counterfactuals", **info)
        advantages = estimate(samples, "tcpo", {**self.cfg.settings.trainer.estimator_params, "counterfactual_scores": scores})
        return trainer.step(samples, advantages, skipped=skipped), info

    def _leap_expand(self, trainer: Any) -> dict[str, Any]:
        """LEAP's data engine (``learner.leap_expand``): probe the next problems, prune them with DCP, expand the useful ones.

        The probes and episodes are recorded as the agent's runs (the probes with their own group tag); this update
        trains on those that have settled, later ones on the rest."""
        from learner.leap_expand import expand

        lc = self.cfg.settings.leap
        first = int(trainer.cursor.get(LEAP_NEXT, 0))
        self._set("expanding", f"LEAP: probing problems {first}..{first + lc.problems_per_update - 1}")
        assert self.cfg.agent is not None
        report = expand(
            self.cfg.admin_url,
            self.cfg.admin_key,
            self.cfg.agent,
            list(range(first, first + lc.problems_per_update)),
            lc.group,
            lc.max_turns,
            seed=lc.seed,
            sample_seed=trainer.version * 1000,
            p_hi=lc.p_hi,
            s_hi=lc.s_hi,
            concurrency=self.cfg.settings.rerollouts.concurrency,
            admin=True,
        )
        out = report.to_dict()
        return {k: out[k] for k in ("n_probed", "fraction_pruned", "expanded", "compile_calls", "elapsed_s")} | {"pruned": out["dcp"]["pruned"]}

    def _svr_runs(self, trainer: Any) -> dict[str, Any]:
        """SVR's fixed-horizon training runs of the next problems (``learner/svr_rollouts.py``); they train once they settle."""
        assert self.cfg.agent is not None
        first = int(trainer.cursor.get(SVR_NEXT, 0))
        self._set("expanding", f"SVR: fixed-horizon runs of problems {first}..{first + self.cfg.settings.svr.problems_per_update - 1}")
        return fixed_horizon_runs(
            self.cfg.admin_url, self.cfg.admin_key, self.cfg.agent, self.cfg.settings.svr, first_problem=first,
            sample_seed=trainer.version * 1000, concurrency=self.cfg.settings.rerollouts.concurrency,
        )  # fmt: skip

    def _reves_round(self, trainer: Any) -> dict[str, Any]:
        """REVES (``learner/reves.py``): augment the next items with the current policy, then run the round's prompts."""
        from learner.reves import reves_round

        assert self.cfg.agent is not None
        rc = self.cfg.settings.reves
        first = int(trainer.cursor.get(REVES_NEXT, 0))
        self._set("expanding", f"REVES: augmenting items {first}..{first + rc.items_per_round - 1}")
        return reves_round(
            self.cfg.admin_url, self.cfg.admin_key, self.cfg.agent, rc, first_item=first, sample_seed=trainer.version * 1000,
            model=self._rollout_model(), concurrency=self.cfg.settings.rerollouts.concurrency,
        )  # fmt: skip

    def _await_recorded(self, trajectory_ids: list[str], timeout_s: float = 30.0) -> None:
        """Wait until the learner's own runs have their outcome stored (the recorder commits in the background), so
        this update's sample window takes them whole; after ``timeout_s`` the stragglers are left to a later update."""
        deadline = time.monotonic() + timeout_s
        pending = list(trajectory_ids)
        while pending and time.monotonic() < deadline:
            pending = [t for t in pending if not ((traj := self.store.get_trajectory(t)) and any(r.target == "trajectory" for r in traj.rewards))]
            if pending:
                time.sleep(0.1)
        if pending:
            log.warning("runs not recorded in time; a later update takes them", pending=len(pending))

    def _rollout_model(self) -> str:
        """The newest policy the runtime can serve: the family's newest published version (loaded if it is not), else the base model."""
        version = self._published_version()
        if version == 0:
            return self._base_model_name()
        name = f"{self.family}@{version}"
        if name in self._rejected_names and self.cfg.settings.restart_from_champion:
            return self._champion() or self._base_model_name()  # the trainer restarted from the champion: sample from it
        loaded = {a["name"] for a in self.admin.list_adapters().get("data", [])}
        if name not in loaded:  # e.g. refused by the gate and unloaded: still the weights the trainer continues from
            path = adapter_path(self.adapter_root, self.family, version)
            self.admin.load(path, self.family, version, sha256=manifest_sha256(path))
        return name

    def _publish_intermediate(self, trainer: Any) -> str:
        """Checkpoint, publish and load the trainer's current weights for the next step's re-rollouts (no gate, no alias).

        The checkpoint comes first and keeps the update's old data cursor: a learner killed after this publish
        resumes at this version (never publishing it a second time with other weights) and redoes the update."""
        ckpt = self.dir / "checkpoints"
        published = checkpoint_and_publish(trainer, ckpt, self.adapter_root, self.family, meta={INTERMEDIATE: True}, admin=self.admin)
        return published.name

    def _publish_and_gate(self, trainer: Any) -> dict[str, Any]:
        version = trainer.version
        self._set("publishing", f"{self.family}@{version}")
        published = publish_adapter(trainer.model, self.adapter_root, self.family, version, meta={"metrics": self.status.last_metrics})
        self.admin.load(published.path, self.family, version, sha256=published.manifest_sha256)
        new = published.name
        parity = self._parity(trainer, new)
        pc = self.cfg.settings.parity
        if parity is not None and parity["mean_abs_logp_diff"] is not None and parity["mean_abs_logp_diff"] > pc.threshold:
            gate = {
                "decision": "refused",
                "reason": f"parity: served and trainer logprobs differ by {parity['mean_abs_logp_diff']:.3g} nats/token (> {pc.threshold:g})",
                "new": new,
                "parity": parity,
            }
            self.status.last_gate = gate
            self._unload(new)
            self._rejected(new, "refused by the parity probe")
            return gate
        champion = self._champion()
        gate = self._gate(new, champion)
        if parity is not None:
            gate["parity"] = parity
        self.status.last_gate = gate
        if gate["decision"] == "refused":
            self._unload(new)
            self._rejected(new, "refused by the eval gate")
        elif champion is None:
            self.admin.set_alias(self.family, new)
            self.status.champion = new
            self._set("idle", f"{new} is the first champion")
        else:
            name = f"{self.family}-v{version}"
            task = self._task()
            self.admin.create_experiment(
                {
                    "name": name,
                    "family": self.family,
                    "arms": [{"adapter": champion, "weight": 1}, {"adapter": new, "weight": 1}],
                    "sticky": "session",
                    # the agent task's verifier; a learner without one (chat traffic) is judged by the users' own feedback,
                    # the rewards it trains on (an experiment's default, the runtime's trusted sources, would never see any)
                    "metric": f"verifier:{task}" if task else "feedback",
                    "min_samples": self.cfg.ab_min_samples,
                    "max_samples": self.cfg.ab_max_samples,
                    "auto_promote": True,
                    "auto_rollback": True,
                }
            )
            self.status.experiment, self.status.challenger = name, new
            self._set("ab", f"experiment {name}: {champion} vs {new}")
        return gate

    def _parity(self, trainer: Any, model: str) -> dict[str, Any] | None:
        """The logprob parity probe of a just-loaded version (``learner/parity.py``); None when it is off or has no turns yet."""
        from learner.parity import parity_probe, probe_turns

        pc = self.cfg.settings.parity
        if not pc.enabled:
            return None
        turn_ids = probe_turns(self.dir, self.store, self._trained, pc.turns)
        if not turn_ids:
            return None
        self._set("probing", f"logprob parity of {model} on {len(turn_ids)} recorded turns")
        headers = {"Authorization": f"Bearer {self.cfg.admin_key}"}
        with httpx.Client(base_url=self.cfg.admin_url, headers=headers, timeout=300) as client:
            report = parity_probe(client, self.store, trainer, model=model, turn_ids=turn_ids, max_tokens=pc.max_tokens)
        report["model"] = model
        self.status.last_parity = report
        log.info("parity probe", **report)
        return report

    def _rejected(self, version: str, why: str) -> None:
        """A version was refused or rolled back: with ``restart_from_champion`` the next update starts from the champion."""
        restart = self.cfg.settings.restart_from_champion
        self._restart = restart
        self._rejected_names.add(version)
        if restart:
            (self.dir / RESTART_FILE).touch()
        self._set("idle", f"{version} {why}" + ("; the next update starts from the champion's weights" if restart else ""))

    def _gate(self, new: str, champion: str | None) -> dict[str, Any]:
        """Held-out success of the new version vs the champion (or the base model), through the runs endpoint."""
        if self.cfg.agent is None or self.cfg.gate_n <= 0:
            return {"decision": "passed", "reason": "no gate configured"}
        self._set("gating", f"{new} vs {champion or 'base'} on {self.cfg.gate_n} held-out problems")
        base = self._base_model_name()
        new_runs = asyncio.run(self._gate_runs(new))
        old_runs = asyncio.run(self._gate_runs(champion or base))
        new_rate = sum(bool(r.get("correct")) for r in new_runs) / len(new_runs)
        old_rate = sum(bool(r.get("correct")) for r in old_runs) / len(old_runs)
        passed = new_rate >= old_rate - self.cfg.gate_tolerance
        return {
            "decision": "passed" if passed else "refused",
            "new": new,
            "champion": champion or base,
            "new_success": new_rate,
            "champion_success": old_rate,
            "tolerance": self.cfg.gate_tolerance,
            "n": self.cfg.gate_n,
            # the adaptive agent's figures (mean turns, wrong-stop rate, ECE of its stated confidence): learner/svr_rollouts.py
            "new_report": adaptive_report(new_runs),
            "champion_report": adaptive_report(old_runs),
        }

    async def _gate_runs(self, model: str) -> list[dict[str, Any]]:
        headers = {"Authorization": f"Bearer {self.cfg.admin_key}"}
        task = self._task()
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=self.cfg.admin_url, headers=headers, timeout=900) as client:

            async def one(i: int) -> dict[str, Any]:
                body: dict[str, Any] = {"problem_index": i, "seed": self.cfg.gate_seed, "model": model, "eval": True}
                if task:
                    body["task"] = task
                async with sem:
                    r = await client.post(f"/admin/agents/{self.cfg.agent}/runs", json=body)  # the admin API's runs: owned by "admin"
                r.raise_for_status()
                out: dict[str, Any] = r.json()
                return out

            return list(await asyncio.gather(*(one(i) for i in range(self.cfg.gate_n))))

    # ---- helpers -------------------------------------------------------------------------------
    def _get_trainer(self) -> Any:
        if self._trainer is None:
            from learner.distributed import RankZeroTrainer, world
            from learner.trainer import LoRATrainer  # torch + peft: only once there is something to train

            s = self.cfg.settings
            # with --nproc N, the workers build, resume and step in lockstep with this trainer (learner/distributed.py)
            factory = RankZeroTrainer if world()[1] > 1 else LoRATrainer
            self._trainer = factory(self.cfg.base_model, s.trainer, s.lora)
            if self._trainer.load_checkpoint(self.dir / "checkpoints") is not None:
                log.info("resumed from checkpoint", version=self._trainer.version)
        return self._trainer

    def _restore_cursor(self) -> None:
        """Where the data window starts, without loading the model: the newest checkpoint's cursor."""
        from learner.trainer import list_checkpoints, read_checkpoint_meta

        ckpts = list_checkpoints(self.dir / "checkpoints") if (self.dir / "checkpoints").is_dir() else []
        if ckpts:
            meta = read_checkpoint_meta(ckpts[-1])
            self.status.version = int(meta.get("version", 0))
            self._seen_since = float(Cursor.from_dict(meta.get("cursor")).since)
        else:
            self._seen_since = 0.0

    def _count_new(self) -> int:
        """New rewarded trajectories of this learner's traffic that have settled (the sample builder would take them now).

        The traffic's kind and agent are checked here; its model names and tags (on the turns) when the update reads them."""
        settled = time.time() - self.cfg.settings.samples.settle_s
        rows = self.store.list_trajectories(limit=100_000, since=self._seen_since, rewarded=True)
        kind = self.traffic.model_copy(update={"models": None, "tags": None})
        return sum(
            1
            for r in rows
            if not r["meta"].get("eval") and not r["meta"].get("rerollout") and traffic_match(r["meta"], kind) and (r["last_turn_at"] or 0) < settled
        )

    def _staleness_floor(self, trainer: Any) -> int:
        """The oldest fresh version: the one the trainer reached ``max_staleness`` updates ago.

        Updates are counted whether their version was published or held during an A/B experiment (the policy
        moved either way), and an RTPO sweep's intermediate versions count as one update. The final versions of
        the last updates ride in the checkpoint (``trainer.cursor["update_versions"]``); a checkpoint without
        them (older learners) falls back to one version per update."""
        k = self.cfg.settings.samples.max_staleness
        versions = _update_versions(trainer)
        if len(versions) > k:
            return versions[-1 - k]
        return max(0, trainer.version - k) if not versions else 0

    def _published_version(self) -> int:
        """The family's newest published version (0 before the first): what the runtime may be serving."""
        versions = [int(p.name[1:]) for p in (self.adapter_root / self.family).glob("v*") if p.name[1:].isdigit()]
        return max(versions, default=0)

    def _task(self) -> str | None:
        """The gate's and the A/B metric's task: configured, else the agent's own."""
        if self.cfg.task is None and self.cfg.agent is not None:
            agents = self.admin._call("GET", "/admin/agents", idempotent=True).get("data", [])
            self.cfg.task = next((a.get("task") for a in agents if a.get("name") == self.cfg.agent), None)
        return self.cfg.task

    def _champion(self) -> str | None:
        aliases = self.admin.list_adapters().get("aliases", {})
        target = aliases.get(self.family)
        return target if isinstance(target, str) else None

    def _base_model_name(self) -> str:
        r = httpx.get(f"{self.cfg.admin_url}/ready", timeout=30)
        r.raise_for_status()
        return str(r.json()["model"])

    def _experiment_running(self, name: str) -> bool:
        try:
            state = self.admin.experiment_status(name)
        except AdminError as exc:
            if exc.status == 404:
                return False
            raise
        if state.get("status") == "running":
            return True
        # a promotion's winner is the champion now; "champion" is the one the experiment started with
        self.status.champion = state.get("winner") or state.get("champion") or self.status.champion
        challenger, self.status.experiment, self.status.challenger = self.status.challenger, None, None
        if state.get("status") == "rolled_back" and challenger is not None:
            if self._held and self.cfg.settings.restart_from_champion:
                self._held = False  # trained on from the rolled-back version: that line is dropped
                log.info("dropping the version held during the experiment: it descends from the rolled-back one", rolled_back=challenger)
            self._rejected(challenger, "was rolled back by its experiment")
        return False

    def _restart_from_champion(self, trainer: Any) -> None:
        """Load the champion's published LoRA (the base model's identity LoRA before any champion), fresh optimizer."""
        from safetensors.torch import load_file

        self._restart = False
        (self.dir / RESTART_FILE).unlink(missing_ok=True)
        champion = self._champion()
        state = None
        if champion is not None:
            _, _, v = champion.partition("@")
            folder = adapter_path(self.adapter_root, self.family, int(v))
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                log.warning("the champion's adapter files are missing; continuing from the trainer's own weights", champion=champion)
                return
            state = load_file(str(files[0]))
        trainer.restart_from(state)
        self.status.restarts += 1
        log.info("restarted from the champion", champion=champion or "base", version=trainer.version)

    def _unload(self, name: str) -> None:
        try:
            self.admin._call("DELETE", f"/admin/adapters/{name}", idempotent=True)
        except AdminError as exc:
            log.warning("could not unload a refused version", adapter=name, error=str(exc))

    def _set(self, state: str, detail: str) -> None:
        self.status.state, self.status.detail, self.status.updated_at = state, detail, time.time()
        tmp = self.dir / "status.json.tmp"
        tmp.write_text(json.dumps(asdict(self.status)))
        os.replace(tmp, self.dir / "status.json")

    def _plot(self) -> None:
        """``reward.png``: mean reward of the trained samples per update (matplotlib, headless)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [json.loads(line) for line in (self.dir / "history.jsonl").read_text().splitlines() if line.strip()]
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(6, 3.5))
        trained = [r for r in rows if r["metrics"]]  # held versions' publish lines carry no metrics
        ax.plot([r["version"] for r in trained], [r["metrics"].get("reward_mean", 0.0) for r in trained], marker="o", label="train reward")
        gated = [(r["version"], r["gate"]["new_success"]) for r in rows if "new_success" in r.get("gate", {})]
        if gated:
            ax.plot(*zip(*gated, strict=True), marker="s", label="held-out success (gate)")
        ax.set_xlabel("version")
        ax.set_ylabel("reward")
        ax.set_title(f"{self.family}: reward per update")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.dir / "reward.png", dpi=90)
        plt.close(fig)


def _update_versions(trainer: Any) -> list[int]:
    """The trainer's version at the end of each of the last updates (oldest first), as its checkpoint keeps them."""
    v = trainer.cursor.get(UPDATE_VERSIONS)
    return [int(x) for x in v] if isinstance(v, list) else []


def _merge_metrics(acc: Any, m: Any) -> Any:
    """One update's metrics from several trainer steps: the last step's values, counts summed, ``optimizer_step`` if any stepped."""
    if acc is None:
        return m
    import dataclasses

    skipped = {k: acc.skipped.get(k, 0) + m.skipped.get(k, 0) for k in {*acc.skipped, *m.skipped}}
    return dataclasses.replace(
        m,
        optimizer_step=acc.optimizer_step or m.optimizer_step,
        samples=acc.samples + m.samples,
        trained_samples=acc.trained_samples + m.trained_samples,
        tokens=acc.tokens + m.tokens,
        step_s=acc.step_s + m.step_s,
        skipped=skipped,
    )
