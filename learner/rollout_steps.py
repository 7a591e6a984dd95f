"""One update's optimizer work, with the re-rollouts and data engines some methods need.

``RolloutSteps._train`` turns the update's samples into advantages (the configured estimator) and trainer
steps: RTPO's reverse sweep (siblings from the exact stored contexts, each step optionally checkpointed and published
as an intermediate version for the next step's re-rollouts; a learner that died mid-sweep resumes it after its last
checkpointed step), TCPO's counterfactual step, or one step, with group
completion or the running baseline for one-off prompts. Before the samples are read, LEAP's, SVR's and
REVES's data engines run the agent (``_leap_expand``, ``_svr_runs``, ``_reves_round``), PATR's trees and RODS's
pool items are the learner's own rollouts (``_own_rollouts``, ``learner/sources.py``; tree samples join the step
with their tree advantages) and ``_await_recorded`` waits for their outcomes. ``_rollout_model`` is the policy re-rollouts sample from.

Not here: planning branch points (``learner/rerollout.py``), the estimators (``learner/advantages.py``), the
step (``learner/trainer.py``), publishing (``learner/release.py``), when an update runs (``learner/scheduler.py``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import time
from typing import Any

import httpx
import structlog

from learner.advantages import Advantages
from learner.baseline import GROUP_ESTIMATORS, singleton_advantages
from learner.parity import ParityRefused
from learner.records import Trajectory
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
from learner.update import estimate

log = structlog.get_logger(__name__)


class RolloutSteps(ServiceState):
    """Training with re-rollouts (mixed into ``LearnerService``; intermediate publishes are ``Release``'s)."""

    def _train(
        self, trainer: Any, samples: list[Sample], skipped: dict[str, int], own: tuple[list[Sample], Advantages, dict[str, Any]] | None = None
    ) -> tuple[Any, dict[str, Any] | None, list[float], list[Sample]]:
        """One update's optimizer work: advantages from the configured estimator, then the trainer's step; RTPO
        sweeps its turns in reverse with siblings, TCPO first scores counterfactuals (``learner/rerollout.py`` plans both).
        One-off prompts (singleton groups) get the running baseline (``learner/baseline.py``) when ``[singletons]`` says so.

        PATR's tree samples (``own``, ``learner/sources.py``) join the step with their tree advantages.

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
        baselined = singleton_advantages(samples, advantages, trainer.cursor.get(BASELINE), sc, tcfg.estimator)
        if baselined is not None:  # "complete": what it did not complete
            advantages, self._baseline_state, self._warmup = baselined
        if own is not None and own[0]:
            from learner.sources import join_tree_samples

            samples, advantages = join_tree_samples(samples, advantages, own)
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
        model = self._rollout_model(trainer)

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
        then published as an intermediate ``family@N`` before the next step's re-rollouts; ``refresh = false``
        samples no refresh runs and keeps the recorded continuations). A branch point whose refresh run failed gets
        no sibling set (its backbone turn keeps trajectory GRPO): the old policy's continuation never stands in for it. A sibling, and the
        backbone turn it is compared with, are scored by their whole continuation's return; every other turn
        gets trajectory GRPO. Without a branch point the sweep is one step: trajectory GRPO.

        Resuming: each intermediate checkpoint carries the sweep's record (``RTPO_SWEEP`` in the trainer's cursor: the
        sample window and batch, the branch points and segments, the steps its weights hold, the policy sampled from,
        the figures so far). A learner that died mid-sweep resumes it from that checkpoint (``_sweep_to_resume``):
        same batch, same plan, the steps after the checkpointed ones only, the next re-rollouts from the checkpoint's
        intermediate version; ``info["resumed"]`` and the status's ``resumed`` say where."""
        rr = self.cfg.settings.rerollouts
        params = self.cfg.settings.trainer.estimator_params
        resume = trainer.cursor.get(RTPO_SWEEP)
        if resume is not None:
            kept = set(resume.get("trajectories") or ())
            left = [s for s in samples if s.trajectory_id in kept]
            if left:
                samples = left  # the recorded batch (its window is fixed; a reward that came later does not add a trajectory)
            else:  # every trajectory of it quarantined or deleted: a new sweep on what the window holds now
                log.warning("none of an interrupted RTPO sweep's trajectories is left; a new sweep starts", version=trainer.version)
                resume = None
        backbones = [t for tid in dict.fromkeys(s.trajectory_id for s in samples) if (t := self.store.get_trajectory(tid)) is not None]
        published_here: list[str] = []
        saved: dict[str, Any] | None = None  # the metrics of the steps a resumed sweep's weights hold
        if resume is None:
            rng = random.Random(f"{trainer.cfg.seed}:{trainer.version}")
            plan = plan_rtpo(backbones, [s.turn_index for s in samples], branches=rr.branches, bucket_size=rr.bucket_size, rng=rng)
            model = self._rollout_model(trainer)
            info: dict[str, Any] = {"estimator": "rtpo", "backbones": len(backbones), "branch_points": len(plan.points), "sibling_runs": 0}
            info.update(refresh_runs=0, refresh_failed_points=0, failed=0, siblings=0, sampled_tokens=0, steps=[], refreshed=[])
            first, start_version = 0, trainer.version
        else:
            by_id = {t.trajectory_id: t for t in backbones}
            points = [BranchPoint(by_id[tid], int(t)) for tid, t in resume["points"] if tid in by_id]
            plan = RtpoPlan(points, [[int(t) for t in seg] for seg in resume["segments"]])
            info = copy.deepcopy(resume["info"])
            published_here = [str(n) for n in resume.get("published", [])]
            first, start_version, saved = int(resume["done"]), int(resume["start_version"]), resume.get("metrics")
            model = self._resumed_model(trainer, resume, info, published_here, samples)
            where = {"step": first + 1, "of": len(plan.segments), "version": trainer.version, "start_version": start_version}
            info["resumed"] = where
            self.status.resumed = {**where, "at": time.time()}
            self._set(
                "training",
                f"version {trainer.version + 1}: resuming an interrupted RTPO sweep at step {first + 1} of {len(plan.segments)} "
                f"(turns {plan.segments[first]}) from version {trainer.version}, which holds its steps 1..{first}",
            )
            log.info("rtpo sweep resumed", **where, turns=plan.segments[first], model=model)
        trajectories = sorted({s.trajectory_id for s in samples})

        def to_samples(traj: Trajectory) -> list[Sample]:  # branches are fresh by construction: no staleness floor
            return trajectory_samples(traj, family=self.family, min_version=0, cfg=self.cfg.settings.samples, counts=SkipCounts())

        merged: Any = None
        for k, turns in enumerate(plan.segments):
            if k < first:
                continue  # in the resumed checkpoint's weights already
            points = [p for p in plan.points if p.turn in turns]
            point_runs = [PointRuns(p) for p in points]
            if points:
                # refresh = false: the backbones keep their recorded continuations (no refresh runs are sampled)
                refresh = [(i, q) for i, p in enumerate(points) if (q := refresh_point(p)) is not None] if rr.refresh else []
                sib = runner.run(points, n=rr.siblings, model=model, kind="rtpo", seed=trainer.version * 131 + k)
                seed = trainer.version * 131 + k
                ref = runner.run([q for _, q in refresh], n=1, model=model, kind="rtpo_refresh", seed=seed + 7) if refresh else []
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
            est_in, train_idx = rtpo_estimator_input(samples, point_runs, set(turns), to_samples, self.cfg.settings.samples.reward_sources)
            advantages = estimate(est_in, "rtpo", params)
            chosen = [est_in[i] for i in train_idx]
            m = trainer.step(chosen, Advantages([advantages[i] for i in train_idx], advantages.stats), skipped=skipped if k == 0 else {})
            n_sib = sum(len(pr.siblings) for pr in point_runs)
            info["siblings"] += n_sib
            info["steps"].append({"turns": turns, "samples": len(chosen), "siblings": n_sib, "optimizer_step": m.optimizer_step})
            if merged is None and saved is not None:  # the steps before the resumed checkpoint count in this update's figures
                names = {f.name for f in dataclasses.fields(m)}
                merged = type(m)(**{key: v for key, v in saved.items() if key in names})
            merged = _merge_metrics(merged, m)
            if rr.refresh and m.optimizer_step and k + 1 < len(plan.segments) and "parity_refused" not in info:
                # the checkpoint _publish_intermediate writes first carries the sweep so far: a learner that dies from here
                # on resumes at step k + 2 with these weights, instead of applying steps 1..k + 1 to them a second time
                trainer.cursor = {
                    **trainer.cursor,
                    RTPO_SWEEP: {
                        "version": trainer.version,
                        "start_version": start_version,
                        **self._window,
                        "trajectories": trajectories,
                        "points": [[p.trajectory.trajectory_id, p.turn] for p in plan.points],
                        "segments": plan.segments,
                        "done": k + 1,
                        "model": model,
                        "published": list(published_here),
                        "info": copy.deepcopy(info),
                        "metrics": dataclasses.asdict(merged),
                    },
                }
                try:  # the next step's re-rollouts continue with this policy, once the parity probe accepts its load
                    model = self._publish_intermediate(trainer, candidates=samples)
                except ParityRefused as exc:  # unloaded and rejected already: the sweep goes on with the last accepted policy
                    info["parity_refused"], info["parity"] = exc.model, exc.report
                    log.warning("rtpo intermediate refused by the parity probe; no more refreshes this sweep", model=exc.model, reason=exc.reason)
                else:
                    published_here.append(model)
                    info["refreshed"].append(model)
        for name in published_here:
            self._unload(name)  # intermediate versions served only this sweep's re-rollouts; the final one is published and gated next
        log.info("rtpo sweep", **{k: v for k, v in info.items() if k != "steps"})
        return merged, info

    def _sweep_to_resume(self, trainer: Any, *, restarted: bool) -> dict[str, Any] | None:
        """The RTPO sweep a dead learner process left mid-way (``RTPO_SWEEP`` in its checkpoint's cursor), if it goes on.

        The record is dropped, and the update starts a new sweep, when the trainer has just restarted from the champion
        (its weights are the pre-sweep ones again: a clean restart), when the learner no longer runs RTPO with
        re-rollouts, or when the record is not of the checkpoint's version."""
        rec = trainer.cursor.get(RTPO_SWEEP)
        if rec is None:
            return None
        rr, why = self.cfg.settings.rerollouts, None
        if not isinstance(rec, dict) or rec.get("version") != trainer.version:
            why = "its record is not the checkpoint's"
        elif restarted:
            why = "the trainer restarted from the champion's weights"
        elif self.cfg.settings.trainer.estimator != "rtpo" or not rr.enabled or self.cfg.agent is None:
            why = "the learner no longer runs RTPO with re-rollouts"
        if why is None:
            return dict(rec)
        trainer.cursor = {k: v for k, v in trainer.cursor.items() if k != RTPO_SWEEP}
        log.warning("an interrupted RTPO sweep is not resumed; the update starts a new one", reason=why, version=trainer.version)
        return None

    def _resumed_model(self, trainer: Any, rec: dict[str, Any], info: dict[str, Any], published: list[str], samples: list[Sample]) -> str:
        """The policy a resumed sweep's next re-rollouts sample from, as the dead process would have had it: the intermediate
        version of the checkpoint it resumes from (published now if the process died before publishing it; else loaded
        and probed again, the verdict having died with it), or, once one was refused or with refresh off, the policy the
        sweep sampled from before. ``info`` and ``published`` (the versions to unload after the sweep) are updated."""
        if self.cfg.settings.rerollouts.refresh and "parity_refused" not in info:
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
        return self._ensure_loaded(int(version)) if family == self.family and version.isdigit() else before

    def _resume_intermediate(self, trainer: Any, samples: list[Sample]) -> str:
        """``Release._publish_intermediate`` for the version a resumed sweep starts from: its checkpoint exists; it may be
        published already (versions are immutable: then it is loaded, not written again) and is probed either way."""
        from learner.publish import adapter_path

        if not adapter_path(self.adapter_root, self.family, trainer.version).exists():
            return str(self._publish_intermediate(trainer, candidates=samples))
        return str(self._probe_intermediate(trainer, self._ensure_loaded(trainer.version), samples))

    def _tcpo_step(self, trainer: Any, runner: BranchRunner, samples: list[Sample], skipped: dict[str, int]) -> tuple[Any, dict[str, Any]]:
        """TCPO (``docs/methods.md``): M one-step alternatives from the exact history of each high-surprisal turn, scored by the verifier."""
        rr = self.cfg.settings.rerollouts
        chosen, points = tcpo_branch_points(samples, self.store, top_q=rr.cf_top_q, threshold=rr.cf_threshold)
        runs = (
            runner.run(points, n=rr.cf_samples, model=self._rollout_model(trainer), kind="tcpo", one_step=True, seed=trainer.version)
            if points
            else []
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
            model=self._rollout_model(trainer),
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
            sample_seed=trainer.version * 1000, concurrency=self.cfg.settings.rerollouts.concurrency, model=self._rollout_model(trainer),
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
            model=self._rollout_model(trainer), concurrency=self.cfg.settings.rerollouts.concurrency,
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

    def _own_rollouts(self, trainer: Any) -> tuple[list[Sample], Advantages, dict[str, Any]]:
        """This update's own rollouts (``learner/sources.py``): PATR trees and/or RODS pool items, with the newest policy;
        RODS's runs (info ``trajectory_ids``) are awaited with the other data engines' before the sample collection."""
        from learner.sources import RolloutSources

        if self._sources is None:
            assert self.cfg.agent is not None
            self._sources = RolloutSources(
                self.cfg.settings, self.dir, self.cfg.admin_url, self.cfg.admin_key, agent=self.cfg.agent, store=self.store, family=self.family
            )
        self._set("expanding", "own rollouts: " + ("PATR trees" if self.cfg.settings.rollouts == "patr" else "RODS pool items"))
        out: tuple[list[Sample], Advantages, dict[str, Any]] = self._sources.round(self._rollout_model(trainer), trainer.version, trainer.cursor)
        return out

    def _rollout_model(self, trainer: Any) -> str:
        """The policy the learner's own runs sample from: the trainer's current weights.

        Usually that is the family's newest published version (loaded if it is not), or the base model before the first.
        While a version is held (an A/B experiment runs, ``Release``), the trainer is ahead of everything published: its
        weights are published as an unaliased intermediate ``family@N`` (as an RTPO sweep's steps are) and sampled from,
        so the learner's runs never sample the experiment's arms (whose routing they would otherwise join through the
        alias) and are fresh by construction; the held version is later released from that same folder."""
        version = self._published_version()
        if trainer.version > version and self._held:
            return self._publish_current(trainer)
        if version == 0:
            return self._base_model_name()
        name = f"{self.family}@{version}"
        if name in self._rejected_names and self.cfg.settings.restart_from_champion:
            return self._champion() or self._base_model_name()  # the trainer restarted from the champion: sample from it
        return self._ensure_loaded(version)  # e.g. refused by the gate and unloaded: still the weights the trainer continues from


def _merge_metrics(acc: Any, m: Any) -> Any:
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
