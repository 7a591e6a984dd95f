"""One update's optimizer work, with the re-rollouts and data engines some methods need.

``RolloutSteps`` is the learner service's training job (one object over the service's shared ``ServiceState``,
publishing its intermediate versions through the service's ``Release``). ``train`` turns the update's samples into
advantages (the configured estimator) and trainer steps: RTPO's reverse sweep (siblings from the exact stored
contexts, each step optionally checkpointed and published as an intermediate version for the next step's
re-rollouts; a learner that died mid-sweep resumes it after its last checkpointed step), TCPO's counterfactual step,
or one step, with group completion or the running baseline for one-off prompts. Before the samples are read, LEAP's,
SVR's and REVES's data engines run the agent (``leap_expand``, ``svr_runs``, ``reves_round``), PATR's trees and
RODS's pool items are the learner's own rollouts (``own_rollouts``, ``learner/sources.py``; tree samples join the
step with their tree advantages) and ``await_recorded`` waits for their outcomes. ``rollout_model`` is the policy
re-rollouts sample from.

Not here: planning branch points (``learner/rerollout.py``), the estimators (``learner/advantages.py``), the
step (``learner/trainer.py``), publishing (``learner/release.py``), when an update runs (``learner/scheduler.py``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import structlog

from learner.advantages import Advantages
from learner.baseline import GROUP_ESTIMATORS, singleton_advantages
from learner.parity import ParityRefused
from learner.records import Trajectory
from learner.release import Release
from learner.rerollout import (
    BranchPoint,
    BranchRunner,
    PointRuns,
    RtpoPlan,
    counterfactual_scores,
    plan_rtpo,
    refresh_point,
    rtpo_estimator_input,
    tcpo_branch_points,
)
from learner.samples import Sample, SkipCounts, trajectory_samples
from learner.service_state import BASELINE, LEAP_NEXT, REVES_NEXT, RTPO_SWEEP, SVR_NEXT, ServiceState
from learner.svr_rollouts import fixed_horizon_runs
from learner.update import Trainer, estimate

if TYPE_CHECKING:
    from learner.group_completion import CompletionReport
    from learner.sources import RolloutSources
    from learner.trainer import StepMetrics

log = structlog.get_logger(__name__)


class EngineTrainer(Protocol):
    """What the data engines read of the trainer: the cursor their next problems come from, the version their sampling
    seeds come from (the live trainer, or the view of the next update that ``overlap_sampling`` samples ahead for)."""

    @property
    def cursor(self) -> dict[str, Any]: ...

    @property
    def version(self) -> int: ...


class RolloutSteps:
    """Training with re-rollouts and data engines: the learner service's training job (module docstring)."""

    def __init__(self, state: ServiceState, release: Release) -> None:
        self.state = state
        self.release = release  # an RTPO sweep's intermediate versions, a held version the learner's own runs sample from
        self.sources: RolloutSources | None = None  # PATR trees, RODS pool: built on the first update that needs them
        self.baseline_state: dict[str, dict[str, float]] | None = None  # the singleton baselines after this update's step
        self.warmup: set[str] = set()  # this update's singleton groups still warming their baseline up

    def train(
        self, trainer: Trainer, samples: list[Sample], skipped: dict[str, int], own: tuple[list[Sample], Advantages, dict[str, Any]] | None = None
    ) -> tuple[StepMetrics, dict[str, Any] | None, list[float], list[Sample]]:
        """One update's optimizer work: advantages from the configured estimator, then the trainer's step; RTPO
        sweeps its turns in reverse with siblings, TCPO first scores counterfactuals (``learner/rerollout.py`` plans both).
        One-off prompts (singleton groups) get the running baseline (``learner/baseline.py``) when ``[singletons]`` says so.

        PATR's tree samples (``own``, ``learner/sources.py``) join the step with their tree advantages.

        Returns the step's metrics, the re-rollouts' report, and the advantages with the samples they belong to (for
        ``learner/reasons.py``; none for RTPO's and TCPO's several steps). ``baseline_state`` and ``warmup`` are this
        update's singleton baselines (None and empty unless the baseline applied)."""
        self.baseline_state, self.warmup = None, set()
        rr = self.state.cfg.settings.rerollouts
        tcfg = self.state.cfg.settings.trainer
        if samples and rr.enabled and self.state.cfg.agent is not None and tcfg.estimator in ("rtpo", "tcpo"):
            runner = BranchRunner(
                self.state.cfg.admin_url, self.state.cfg.admin_key, agent=self.state.cfg.agent, store=self.state.store, concurrency=rr.concurrency
            )
            if tcfg.estimator == "rtpo":
                m, report = self._rtpo_sweep(trainer, runner, samples, skipped)
            else:
                m, report = self._tcpo_step(trainer, runner, samples, skipped)
            return m, report, [], []  # several steps' advantages: the reasons count the sample builder's losses only
        sc = self.state.cfg.settings.singletons
        info: dict[str, Any] | None = None
        if sc.mode == "complete" and tcfg.estimator in GROUP_ESTIMATORS:
            samples, info = self._complete_groups(trainer, samples)
        advantages = estimate(samples, tcfg.estimator, tcfg.estimator_params)
        baselined = singleton_advantages(samples, advantages, trainer.cursor.get(BASELINE), sc, tcfg.estimator)
        if baselined is not None:  # "complete": what it did not complete
            advantages, self.baseline_state, self.warmup = baselined
        if own is not None and own[0]:
            from learner.sources import join_tree_samples

            samples, advantages = join_tree_samples(samples, advantages, own)
        return trainer.step(samples, advantages, skipped=skipped), info, list(advantages), samples

    def _complete_groups(self, trainer: Trainer, samples: list[Sample]) -> tuple[list[Sample], dict[str, Any]]:
        """Group completion (``learner/group_completion.py``): each one-off conversation's last rated turn is replaced by
        its completed group (the original and ``group_size - 1`` siblings sampled by the newest policy, all scored by the
        configured hook or judge); a multi-turn one's earlier turns keep the running baseline (``merge_completed``)."""
        from learner.group_completion import GroupCompleter, merge_completed

        sc = self.state.cfg.settings.singletons
        candidates = GroupCompleter.candidates(samples)
        if not candidates:
            return samples, {"group_completion": "no one-off conversations"}
        self.state.set_status(
            "completing", f"group completion: {min(len(candidates), sc.max_turns_per_update)} one-off turns x {sc.group_size - 1} siblings"
        )
        model = self.rollout_model(trainer)

        async def run() -> CompletionReport:
            headers = {"Authorization": f"Bearer {self.state.cfg.admin_key}"}
            async with httpx.AsyncClient(base_url=self.state.cfg.admin_url, headers=headers, timeout=sc.timeout_s) as client:
                completer = GroupCompleter(client, self.state.store, cfg=sc, family=self.state.family, samples_cfg=self.state.cfg.settings.samples)
                return await completer.complete(candidates, model=model, seed=trainer.version + 1)

        report = asyncio.run(run())
        info = {"model": model, **report.as_dict()}
        log.info("group completion", **info)
        return merge_completed(samples, report), info

    def _rtpo_sweep(
        self, trainer: Trainer, runner: BranchRunner, samples: list[Sample], skipped: dict[str, int]
    ) -> tuple[StepMetrics, dict[str, Any]]:
        """RTPO (``docs/methods.md#rtpo``): K branch turns per backbone, m siblings each, optimizer steps latest turns first.

        Before each step, the siblings of its branch points and a refresh of each backbone's own continuation
        are sampled from the exact stored contexts by the newest policy (``refresh``: each step is checkpointed,
        then published as an intermediate ``family@N`` before the next step's re-rollouts; ``refresh = false``
        samples no refresh runs and keeps the recorded continuations). A branch point whose refresh run failed gets
        no sibling set (its backbone turn keeps trajectory GRPO): the old policy's continuation never stands in for it. A sibling, and the
        backbone turn it is compared with, are scored by their whole continuation's return; every other turn
        gets trajectory GRPO. Without a branch point the sweep is one step: trajectory GRPO.

        Resuming: each intermediate checkpoint carries the sweep's record (``RTPO_SWEEP`` in the trainer's cursor: the
        sample window and batch, the branch points and segments, the steps its weights hold, the policy sampled from,
        the figures so far). A learner that died mid-sweep resumes it from that checkpoint (``sweep_to_resume``):
        same batch, same plan, the steps after the checkpointed ones only, the next re-rollouts from the checkpoint's
        intermediate version; ``info["resumed"]`` and the status's ``resumed`` say where."""
        rr = self.state.cfg.settings.rerollouts
        sweep = self._start_sweep(trainer, samples)
        for k, turns in enumerate(sweep.plan.segments):
            if k < sweep.first:
                continue  # in the resumed checkpoint's weights already
            point_runs = self._sweep_rerollouts(trainer, runner, sweep, k, turns)
            m = self._sweep_step(trainer, sweep, turns, point_runs, skipped=skipped if k == 0 else {})
            if rr.refresh and m.optimizer_step and k + 1 < len(sweep.plan.segments) and "parity_refused" not in sweep.info:
                self._publish_sweep_step(trainer, sweep, done=k + 1)
        assert sweep.merged is not None  # a sweep has at least one step, and a resumed one at least one left
        for name in sweep.published:
            self.state.unload(name)  # intermediate versions served only this sweep's re-rollouts; the final one is published and gated next
        log.info("rtpo sweep", **{k: v for k, v in sweep.info.items() if k != "steps"})
        return sweep.merged, sweep.info

    def _start_sweep(self, trainer: Trainer, samples: list[Sample]) -> _Sweep:
        """The sweep this update runs: the interrupted one the checkpoint records (``RTPO_SWEEP``), on what is left of its
        batch, or a new one on ``samples``."""
        resume = trainer.cursor.get(RTPO_SWEEP)
        if resume is not None:
            kept = set(resume.get("trajectories") or ())
            left = [s for s in samples if s.trajectory_id in kept]
            if left:
                samples = left  # the recorded batch (its window is fixed; a reward that came later does not add a trajectory)
            else:  # every trajectory of it quarantined or deleted: a new sweep on what the window holds now
                log.warning("none of an interrupted RTPO sweep's trajectories is left; a new sweep starts", version=trainer.version)
                resume = None
        backbones = [t for tid in dict.fromkeys(s.trajectory_id for s in samples) if (t := self.state.store.get_trajectory(tid)) is not None]
        if resume is None:
            return self._new_sweep(trainer, samples, backbones)
        return self._resumed_sweep(trainer, samples, backbones, resume)

    def _new_sweep(self, trainer: Trainer, samples: list[Sample], backbones: list[Trajectory]) -> _Sweep:
        """A sweep planned on ``samples`` (seeded by the trainer's seed and version), sampling from the current policy."""
        rr = self.state.cfg.settings.rerollouts
        rng = random.Random(f"{trainer.cfg.seed}:{trainer.version}")
        plan = plan_rtpo(backbones, [s.turn_index for s in samples], branches=rr.branches, bucket_size=rr.bucket_size, rng=rng)
        model = self.rollout_model(trainer)
        info: dict[str, Any] = {"estimator": "rtpo", "backbones": len(backbones), "branch_points": len(plan.points), "sibling_runs": 0}
        info.update(refresh_runs=0, refresh_failed_points=0, failed=0, siblings=0, sampled_tokens=0, steps=[], refreshed=[])
        return _Sweep(samples, plan, model, info, first=0, start_version=trainer.version)

    def _resumed_sweep(self, trainer: Trainer, samples: list[Sample], backbones: list[Trajectory], resume: dict[str, Any]) -> _Sweep:
        """The recorded sweep, from the step after the checkpoint's ones: its plan, figures and intermediate versions, the
        policy it samples from next (``_resumed_model``); the status and ``info["resumed"]`` say where it resumes."""
        by_id = {t.trajectory_id: t for t in backbones}
        points = [BranchPoint(by_id[tid], int(t)) for tid, t in resume["points"] if tid in by_id]
        plan = RtpoPlan(points, [[int(t) for t in seg] for seg in resume["segments"]])
        info = copy.deepcopy(resume["info"])
        published = [str(n) for n in resume.get("published", [])]
        first, start_version, saved = int(resume["done"]), int(resume["start_version"]), resume.get("metrics")
        model = self._resumed_model(trainer, resume, info, published, samples)
        where = {"step": first + 1, "of": len(plan.segments), "version": trainer.version, "start_version": start_version}
        info["resumed"] = where
        self.state.status.resumed = {**where, "at": time.time()}
        self.state.set_status(
            "training",
            f"version {trainer.version + 1}: resuming an interrupted RTPO sweep at step {first + 1} of {len(plan.segments)} "
            f"(turns {plan.segments[first]}) from version {trainer.version}, which holds its steps 1..{first}",
        )
        log.info("rtpo sweep resumed", **where, turns=plan.segments[first], model=model)
        return _Sweep(samples, plan, model, info, first=first, start_version=start_version, published=published, saved=saved)

    def _sweep_rerollouts(self, trainer: Trainer, runner: BranchRunner, sweep: _Sweep, k: int, turns: list[int]) -> list[PointRuns]:
        """Step ``k``'s re-rollouts from the sweep's current policy: the siblings of its branch points on ``turns`` and, with
        ``refresh``, each backbone's own continuation again; their counts go to the sweep's figures."""
        rr, info = self.state.cfg.settings.rerollouts, sweep.info
        points = [p for p in sweep.plan.points if p.turn in turns]
        point_runs = [PointRuns(p) for p in points]
        if points:
            # refresh = false: the backbones keep their recorded continuations (no refresh runs are sampled)
            refresh = [(i, q) for i, p in enumerate(points) if (q := refresh_point(p)) is not None] if rr.refresh else []
            sib = runner.run(points, n=rr.siblings, model=sweep.model, kind="rtpo", seed=trainer.version * 131 + k)
            seed = trainer.version * 131 + k
            ref = runner.run([q for _, q in refresh], n=1, model=sweep.model, kind="rtpo_refresh", seed=seed + 7) if refresh else []
            for r in sib:
                if r.trajectory is not None:
                    point_runs[points.index(r.point)].siblings.append(r.trajectory)
            for (i, _), r in zip(refresh, ref, strict=True):
                point_runs[i].refresh = r.trajectory
                point_runs[i].refresh_failed = r.trajectory is None  # never replaced by the old policy's continuation
            runs = [*sib, *ref]
            info["sibling_runs"] += len(sib)
            info["refresh_runs"] += len(ref)
            info["failed"] += sum(1 for r in runs if r.error)
            info["sampled_tokens"] += sum(len(t.output_ids) for r in runs if r.trajectory is not None for t in r.trajectory.turns)
        info["refresh_failed_points"] += sum(1 for pr in point_runs if pr.refresh_failed)
        return point_runs

    def _sweep_step(self, trainer: Trainer, sweep: _Sweep, turns: list[int], point_runs: list[PointRuns], skipped: dict[str, int]) -> StepMetrics:
        """One optimizer step of the sweep, on the samples of ``turns``: RTPO's advantages with the siblings; the step's
        figures go to the sweep's, its metrics into ``sweep.merged``."""
        reward_sources = self.state.cfg.settings.samples.reward_sources
        est_in, train_idx = rtpo_estimator_input(sweep.samples, point_runs, set(turns), self._branch_samples, reward_sources)
        advantages = estimate(est_in, "rtpo", self.state.cfg.settings.trainer.estimator_params)
        chosen = [est_in[i] for i in train_idx]
        m = trainer.step(chosen, Advantages([advantages[i] for i in train_idx], advantages.stats), skipped=skipped)
        n_sib = sum(len(pr.siblings) for pr in point_runs)
        sweep.info["siblings"] += n_sib
        sweep.info["steps"].append({"turns": turns, "samples": len(chosen), "siblings": n_sib, "optimizer_step": m.optimizer_step})
        if sweep.merged is None and sweep.saved is not None:  # the steps before the resumed checkpoint count in this update's figures
            names = {f.name for f in dataclasses.fields(m)}
            sweep.merged = type(m)(**{key: v for key, v in sweep.saved.items() if key in names})
        sweep.merged = _merge_metrics(sweep.merged, m)
        return m

    def _branch_samples(self, traj: Trajectory) -> list[Sample]:
        """A re-rollout's samples; branches are fresh by construction: no staleness floor."""
        return trajectory_samples(traj, family=self.state.family, min_version=0, cfg=self.state.cfg.settings.samples, counts=SkipCounts())

    def _publish_sweep_step(self, trainer: Trainer, sweep: _Sweep, *, done: int) -> None:
        """After the sweep's step ``done``: its weights checkpointed with the sweep's record, published as an intermediate
        version and, once the parity probe accepts its load, the policy the next step's re-rollouts sample from."""
        merged = sweep.merged
        assert merged is not None  # the step just taken
        # the checkpoint publish_intermediate writes first carries the sweep so far: a learner that dies from here
        # on resumes at step done + 1 with these weights, instead of applying steps 1..done to them a second time
        trainer.cursor = {
            **trainer.cursor,
            RTPO_SWEEP: {
                "version": trainer.version,
                "start_version": sweep.start_version,
                **self.state.window,
                "trajectories": sorted({s.trajectory_id for s in sweep.samples}),
                "points": [[p.trajectory.trajectory_id, p.turn] for p in sweep.plan.points],
                "segments": sweep.plan.segments,
                "done": done,
                "model": sweep.model,
                "published": list(sweep.published),
                "info": copy.deepcopy(sweep.info),
                "metrics": dataclasses.asdict(merged),
            },
        }
        try:  # the next step's re-rollouts continue with this policy, once the parity probe accepts its load
            sweep.model = self.release.publish_intermediate(trainer, candidates=sweep.samples)
        except ParityRefused as exc:  # unloaded and rejected already: the sweep goes on with the last accepted policy
            sweep.info["parity_refused"], sweep.info["parity"] = exc.model, exc.report
            log.warning("rtpo intermediate refused by the parity probe; no more refreshes this sweep", model=exc.model, reason=exc.reason)
        else:
            sweep.published.append(sweep.model)
            sweep.info["refreshed"].append(sweep.model)

    def sweep_to_resume(self, trainer: Trainer, *, restarted: bool) -> dict[str, Any] | None:
        """The RTPO sweep a dead learner process left mid-way (``RTPO_SWEEP`` in its checkpoint's cursor), if it goes on.

        The record is dropped, and the update starts a new sweep, when the trainer has just restarted from the champion
        (its weights are the pre-sweep ones again: a clean restart), when the learner no longer runs RTPO with
        re-rollouts, or when the record is not of the checkpoint's version."""
        rec = trainer.cursor.get(RTPO_SWEEP)
        if rec is None:
            return None
        rr, why = self.state.cfg.settings.rerollouts, None
        if not isinstance(rec, dict) or rec.get("version") != trainer.version:
            why = "its record is not the checkpoint's"
        elif restarted:
            why = "the trainer restarted from the champion's weights"
        elif self.state.cfg.settings.trainer.estimator != "rtpo" or not rr.enabled or self.state.cfg.agent is None:
            why = "the learner no longer runs RTPO with re-rollouts"
        if why is None:
            return dict(rec)
        trainer.cursor = {k: v for k, v in trainer.cursor.items() if k != RTPO_SWEEP}
        log.warning("an interrupted RTPO sweep is not resumed; the update starts a new one", reason=why, version=trainer.version)
        return None

    def _resumed_model(self, trainer: Trainer, rec: dict[str, Any], info: dict[str, Any], published: list[str], samples: list[Sample]) -> str:
        """The policy a resumed sweep's next re-rollouts sample from, as the dead process would have had it: the intermediate
        version of the checkpoint it resumes from (published now if the process died before publishing it; else loaded
        and probed again, the verdict having died with it), or, once one was refused or with refresh off, the policy the
        sweep sampled from before. ``info`` and ``published`` (the versions to unload after the sweep) are updated."""
        if self.state.cfg.settings.rerollouts.refresh and "parity_refused" not in info:
            try:
                name = self._resume_intermediate(trainer, samples)
            except ParityRefused as exc:
                info["parity_refused"], info["parity"] = exc.model, exc.report
                log.warning("rtpo intermediate refused by the parity probe; no more refreshes this sweep", model=exc.model, reason=exc.reason)
            else:
                published.append(name)
                info["refreshed"].append(name)
                return name
        before = str(rec["model"])
        family, _, version = before.partition("@")
        return self.state.ensure_loaded(int(version)) if family == self.state.family and version.isdigit() else before

    def _resume_intermediate(self, trainer: Trainer, samples: list[Sample]) -> str:
        """``Release.publish_intermediate`` for the version a resumed sweep starts from: its checkpoint exists; it may be
        published already (versions are immutable: then it is loaded, not written again) and is probed either way."""
        from learner.publish import adapter_path

        if not adapter_path(self.state.adapter_root, self.state.family, trainer.version).exists():
            return str(self.release.publish_intermediate(trainer, candidates=samples))
        return str(self.release.probe_intermediate(trainer, self.state.ensure_loaded(trainer.version), samples))

    def _tcpo_step(
        self, trainer: Trainer, runner: BranchRunner, samples: list[Sample], skipped: dict[str, int]
    ) -> tuple[StepMetrics, dict[str, Any]]:
        """TCPO (``docs/methods.md``): M one-step alternatives from the exact history of each high-surprisal turn, scored by the verifier."""
        rr = self.state.cfg.settings.rerollouts
        chosen, points = tcpo_branch_points(samples, self.state.store, top_q=rr.cf_top_q, threshold=rr.cf_threshold)
        runs = (
            runner.run(points, n=rr.cf_samples, model=self.rollout_model(trainer), kind="tcpo", one_step=True, seed=trainer.version) if points else []
        )
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
        advantages = estimate(samples, "tcpo", {**self.state.cfg.settings.trainer.estimator_params, "counterfactual_scores": scores})
        return trainer.step(samples, advantages, skipped=skipped), info

    def leap_expand(self, trainer: EngineTrainer, *, model: str, announce: bool = True) -> dict[str, Any]:
        """LEAP's data engine (``learner.leap_expand``): probe the next problems, prune them with DCP, expand the useful ones.

        The probes and episodes are recorded as the agent's runs (the probes with their own group tag); this update
        trains on those that have settled, later ones on the rest.

        Every data engine here reads its next problems from ``trainer.cursor`` and its sampling seeds from
        ``trainer.version``, and samples ``model`` (the service passes :meth:`rollout_model`); ``announce=False`` leaves
        the status alone (an engine running in the background while the trainer steps: ``overlap_sampling``)."""
        from learner.leap_expand import expand

        lc = self.state.cfg.settings.leap
        first = int(trainer.cursor.get(LEAP_NEXT, 0))
        if announce:
            self.state.set_status("expanding", f"LEAP: probing problems {first}..{first + lc.problems_per_update - 1}")
        assert self.state.cfg.agent is not None
        report = expand(
            self.state.cfg.admin_url,
            self.state.cfg.admin_key,
            self.state.cfg.agent,
            list(range(first, first + lc.problems_per_update)),
            lc.group,
            lc.max_turns,
            seed=lc.seed,
            sample_seed=trainer.version * 1000,
            p_hi=lc.p_hi,
            s_hi=lc.s_hi,
            concurrency=self.state.cfg.settings.rerollouts.concurrency,
            admin=True,
            model=model,
        )
        out = report.to_dict()
        return {k: out[k] for k in ("n_probed", "fraction_pruned", "expanded", "compile_calls", "elapsed_s")} | {"pruned": out["dcp"]["pruned"]}

    def svr_runs(self, trainer: EngineTrainer, *, model: str, announce: bool = True) -> dict[str, Any]:
        """SVR's fixed-horizon training runs of the next problems (``learner/svr_rollouts.py``); they train once they settle."""
        assert self.state.cfg.agent is not None
        first = int(trainer.cursor.get(SVR_NEXT, 0))
        if announce:
            self.state.set_status(
                "expanding", f"SVR: fixed-horizon runs of problems {first}..{first + self.state.cfg.settings.svr.problems_per_update - 1}"
            )
        return fixed_horizon_runs(
            self.state.cfg.admin_url, self.state.cfg.admin_key, self.state.cfg.agent, self.state.cfg.settings.svr, first_problem=first,
            sample_seed=trainer.version * 1000, concurrency=self.state.cfg.settings.rerollouts.concurrency,
            model=model,
        )  # fmt: skip

    def reves_round(self, trainer: EngineTrainer, *, model: str, announce: bool = True) -> dict[str, Any]:
        """REVES (``learner/reves.py``): augment the next items with the current policy, then run the round's prompts."""
        from learner.reves import reves_round

        assert self.state.cfg.agent is not None
        rc = self.state.cfg.settings.reves
        first = int(trainer.cursor.get(REVES_NEXT, 0))
        if announce:
            self.state.set_status("expanding", f"REVES: augmenting items {first}..{first + rc.items_per_round - 1}")
        return reves_round(
            self.state.cfg.admin_url, self.state.cfg.admin_key, self.state.cfg.agent, rc, first_item=first, sample_seed=trainer.version * 1000,
            model=model, concurrency=self.state.cfg.settings.rerollouts.concurrency,
        )  # fmt: skip

    def await_recorded(self, trajectory_ids: list[str], timeout_s: float = 30.0) -> None:
        """Wait until the learner's own runs have their outcome stored (the recorder commits in the background), so
        this update's sample window takes them whole; after ``timeout_s`` the stragglers are left to a later update."""
        deadline = time.monotonic() + timeout_s
        pending = list(trajectory_ids)
        while pending and time.monotonic() < deadline:
            pending = [
                t for t in pending if not ((traj := self.state.store.get_trajectory(t)) and any(r.target == "trajectory" for r in traj.rewards))
            ]
            if pending:
                time.sleep(0.1)
        if pending:
            log.warning("runs not recorded in time; a later update takes them", pending=len(pending))

    def own_rollouts(self, trainer: EngineTrainer, *, model: str, announce: bool = True) -> tuple[list[Sample], Advantages, dict[str, Any]]:
        """This update's own rollouts (``learner/sources.py``): PATR trees and/or RODS pool items, with the newest policy;
        RODS's runs (info ``trajectory_ids``) are awaited with the other data engines' before the sample collection."""
        from learner.sources import RolloutSources

        if self.sources is None:
            assert self.state.cfg.agent is not None
            self.sources = RolloutSources(
                self.state.cfg.settings,
                self.state.dir,
                self.state.cfg.admin_url,
                self.state.cfg.admin_key,
                agent=self.state.cfg.agent,
                store=self.state.store,
                family=self.state.family,
            )
        if announce:
            self.state.set_status("expanding", "own rollouts: " + ("PATR trees" if self.state.cfg.settings.rollouts == "patr" else "RODS pool items"))
        out: tuple[list[Sample], Advantages, dict[str, Any]] = self.sources.round(model, trainer.version, trainer.cursor)
        return out

    def rollout_model(self, trainer: Trainer) -> str:
        """The policy the learner's own runs sample from: the trainer's current weights.

        Usually that is the family's newest published version (loaded if it is not), or the base model before the first.
        While a version is held (an A/B experiment runs, ``Release``), the trainer is ahead of everything published: its
        weights are published as an unaliased intermediate ``family@N`` (as an RTPO sweep's steps are) and sampled from,
        so the learner's runs never sample the experiment's arms (whose routing they would otherwise join through the
        alias) and are fresh by construction; the held version is later released from that same folder."""
        version = self.state.published_version()
        if trainer.version > version and self.state.held:
            return self.release.publish_current(trainer)
        if version == 0:
            return self.state.base_model_name()
        name = f"{self.state.family}@{version}"
        if name in self.state.rejected_names and self.state.cfg.settings.restart_from_champion:
            return self.state.champion() or self.state.base_model_name()  # the trainer restarted from the champion: sample from it
        return self.state.ensure_loaded(version)  # e.g. refused by the gate and unloaded: still the weights the trainer continues from


def _merge_metrics(acc: StepMetrics | None, m: StepMetrics) -> StepMetrics:
    """One update's metrics from several trainer steps: the last step's values, counts summed, ``optimizer_step`` if any stepped."""
    if acc is None:
        return m
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


@dataclasses.dataclass
class _Sweep:
    """An RTPO sweep under way: its batch and plan, the policy its re-rollouts sample from, its figures (``info``), the
    step it starts at (a resumed sweep's checkpoint holds the steps before, their metrics in ``saved``)."""

    samples: list[Sample]
    plan: RtpoPlan
    model: str
    info: dict[str, Any]
    first: int
    start_version: int  # the trainer's version before the sweep's first step
    published: list[str] = dataclasses.field(default_factory=list)  # its intermediate versions, unloaded after the sweep
    saved: dict[str, Any] | None = None
    merged: StepMetrics | None = None  # the metrics of the steps so far
