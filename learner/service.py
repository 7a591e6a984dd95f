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
   ``gate_tolerance`` is unloaded. The problems and sampling seeds are fixed (``gate_seed``), so a model's runs are
   kept by name and a champion is not run again at every gate (the record's ``champion_runs``: ``run``/``reused``).
5. **A/B**: the first passing version becomes the champion (alias set); later ones enter an experiment
   against the champion with auto-promote and auto-rollback on the task's verifier reward (without an agent
   task, as for chat traffic: on the users' ``feedback``).
6. **Rejected lines are not descended**: a version refused by the gate or the parity probe, or rolled back by
   its experiment, makes the next update start from the champion's weights with a fresh optimizer
   (``restart_from_champion``).

Own rollouts (``learner/sources.py``): with ``rollouts = "patr"`` or ``[rods] enabled`` the learner does not wait
for traffic: every round is an update that first makes its own rollouts (PATR trees, RODS pool items) through
the runs endpoint and trains on them (trees: their node samples with the tree advantage, next to the live
samples; RODS runs: through the store, like traffic). Their figures go to the status (``sources``) and history.
With ``overlap_sampling`` the next update's own runs (and LEAP's, SVR's, REVES's) are sampled in a background thread
while the current update's step trains, from the policy before the step; the next update takes them if it starts at
the engine positions they were made for, and otherwise samples its own (``_sample_ahead``, ``_take_ahead``).

State for people: ``<data-dir>/learner/<family>/status.json`` (served by ``GET /admin/learner``),
``history.jsonl`` (one line per update) and ``reward.png`` (reward per update).

**Crashes** (``learner/quarantine.py``): an update that raises an unexpected exception is recorded (status
``error`` with ``last_error``: type, message, the traceback's last lines; the batch's failure count in
``inflight.json``) and the process exits with status 1: ``serve.py`` restarts it (``learner/supervisor.py``)
from its last checkpoint, because a half-stepped trainer must not go on. The restarted process counts a batch
whose update a dead predecessor left unfinished (SIGKILL, OOM) as failed too, and retries the batch at once.
An RTPO sweep checkpoints each of its steps before publishing it for the next step's re-rollouts; its retry resumes the
sweep after the last checkpointed step on the same sample window, never applying a step twice (``learner/rollout_steps.py``;
the status's ``resumed`` and the history's ``rerollouts.resumed`` say where).
A batch that failed twice is quarantined: its trajectories are skipped by every later update (``quarantined``
in the skip counts) and named in the status (``quarantine``). The runtime being away (admin API or HTTP errors)
is not a crash: the round is retried. A configuration the learner refuses exits with status 2.

Where each job lives: this module is the process (start-up, the round loop, signals, a dead parent server)
and one update (samples → train → checkpoint → history); the jobs are objects the service holds, each over one
shared ``ServiceState`` (``learner/service_state.py``: the configuration, the status, the typed trainer and the state
they share): ``Scheduler`` (``learner/scheduler.py``) decides when an update runs; ``RolloutSteps``
(``learner/rollout_steps.py``) does the optimizer work with re-rollouts (RTPO, TCPO, group completion) and the
data engines (LEAP, SVR, REVES); ``Release`` (``learner/release.py``) publishes, gates, crowns a champion and runs
the A/B.

Not here: how samples, steps and publishing work (``samples``, ``trainer``, ``publish``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import structlog

from learner.advantages import Advantages
from learner.config import TrafficFilter
from learner.publish import AdminError, RuntimeAdmin, clean_staging
from learner.quarantine import BatchLedger, Outcome, error_record
from learner.reasons import unused_reasons
from learner.release import Release
from learner.reward_plot import plot_rewards
from learner.rollout_steps import EngineTrainer, RolloutSteps
from learner.samples import Cursor, Sample, collect_samples
from learner.scheduler import Scheduler
from learner.service_state import (
    BASELINE,
    LEAP_NEXT,
    LINEAGE_START,
    REQUEST_FILE,
    RESTART_FILE,
    REVES_NEXT,
    RTPO_SWEEP,
    SVR_NEXT,
    UPDATE_VERSIONS,
    LearnerConfigError,
    ServiceConfig,
    ServiceState,
    Status,
    learner_dir,
    update_timings,
    update_versions,
)
from learner.svr_rewards import apply_self_check_rewards
from learner.update import Trainer

__all__ = [
    "REQUEST_FILE",
    "LearnerConfigError",
    "LearnerService",
    "ServiceConfig",
    "Status",
    "die_with_parent",
    "learner_dir",
]

log = structlog.get_logger(__name__)


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


class LearnerService:
    """The learner process for one adapter family (see the module docstring). Its jobs are objects over one shared
    ``ServiceState``: ``scheduler`` (when an update runs), ``steps`` (the optimizer work with re-rollouts and data engines)
    and ``release`` (publish, gate, champion, A/B)."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.state = ServiceState(cfg)
        self.release = Release(self.state)
        self.steps = RolloutSteps(self.state, self.release)
        self.scheduler = Scheduler(self.state, self.release)
        self._failure: Outcome | None = None  # what the last failed update did to its batch's count (for the crash record)
        self._stop = False
        self._busy = False  # inside a scheduling round (an update, a publish, a gate)
        self._checked = False
        self._ahead: _Ahead | None = None  # the next update's engine runs, sampled while this update trains (overlap_sampling)
        # set by serve.py: the learner stops when its server does (uvicorn re-raises SIGTERM, so the server cannot always stop it)
        parent = os.environ.get("LOOPWISE_LEARNER_PARENT")
        self._parent = int(parent) if parent and parent.isdigit() and int(parent) == os.getppid() else None

    # the handles the process's callers and tests read (all the shared state's)
    @property
    def cfg(self) -> ServiceConfig:
        return self.state.cfg

    @property
    def dir(self) -> Path:
        return self.state.dir

    @property
    def store(self) -> Any:
        return self.state.store

    @property
    def admin(self) -> RuntimeAdmin:
        return self.state.admin

    @property
    def traffic(self) -> TrafficFilter:
        return self.state.traffic

    @property
    def status(self) -> Status:
        return self.state.status

    @property
    def ledger(self) -> BatchLedger:
        return self.state.ledger

    # ---- the loop ------------------------------------------------------------------------------
    def run_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._parent is not None:
            die_with_parent(self._parent)  # SIGTERM when the server dies: the polling in _sleep only notices between rounds
        removed = clean_staging(self.state.adapter_root)
        if removed:
            log.info("removed half-published adapters", paths=[str(p) for p in removed])
        self._restore_cursor()
        self._recover_batch()
        try:
            self.check_setup()
        except LearnerConfigError as exc:
            self.state.set_status("error", str(exc))
            raise
        except (AdminError, httpx.HTTPError):  # the runtime is not up yet: checked again before the first update
            pass
        while not self._stop:
            try:
                self._busy = True
                self.tick()
            except (AdminError, httpx.HTTPError) as exc:  # the runtime is away (restarting?): retry next round
                self.state.set_status("error", f"runtime admin API: {exc}")
                log.warning("learner round failed", error=str(exc))
            except LearnerConfigError:
                raise
            except Exception as exc:  # anything else: record it and exit, so serve.py restarts us from the last checkpoint
                self._crash(exc)
            finally:
                self._busy = False
            self._sleep(self.state.cfg.poll_s)
        self.state.set_status("stopped", "")
        self.state.admin.close()
        self.state.store.close()

    def tick(self) -> bool:
        """One scheduling round, as ``Scheduler.next_round`` decides it; returns whether an update ran."""
        r = self.scheduler.next_round()
        if r.action == "publish_held":
            self.release.publish_held()
            return True
        if r.action == "wait":
            return False
        record = self.update(force=r.force, publish=r.publish)
        return bool(record["metrics"])

    def _sleep(self, seconds: float) -> None:
        """Wait between rounds; wake on an update request file, stop when the server that started this learner is gone."""
        end = time.monotonic() + seconds
        while not self._stop and time.monotonic() < end and not (self.state.dir / REQUEST_FILE).exists():
            if self._parent is not None and os.getppid() != self._parent:
                log.info("the server that started this learner is gone; stopping", parent=self._parent)
                self.stop()
                break
            time.sleep(min(0.5, seconds))

    def stop(self) -> None:
        self._stop = True

    def _on_sigterm(self, *_: Any) -> None:
        """Stop after this round; orphaned mid-round (the server died), abandon it: checkpoints and publishes are atomic.
        Either way an update cut short from now on is a stop, not a failure of its batch (``ledger.terminating``)."""
        self.state.ledger.terminating()
        self.stop()
        if self._busy and self._parent is not None and os.getppid() != self._parent:
            raise SystemExit(143)

    # ---- crashes --------------------------------------------------------------------------------
    def _recover_batch(self) -> None:
        """At start: a batch the previous process did not finish is counted (a death mid-update is a failure) and retried
        at the first round; the quarantine and a failing batch go into the status."""
        outcome = self.state.ledger.recover()
        if outcome is not None:
            self.scheduler.retry = True
            if outcome.counted:
                self.state.status.crashes += 1
                self.state.status.last_error = outcome.error | {"failures": outcome.failures, "quarantined": outcome.quarantined}
                log.error("the previous learner process died during an update", error=outcome.error["message"], failures=outcome.failures)
            log.info("retrying the update the previous learner process did not finish", failures_so_far=outcome.failures)
        self.state.ledger_status()

    def _crash(self, exc: Exception) -> NoReturn:
        """Record an update that raised (status ``error``, ``last_error``, the log) and exit with status 1."""
        outcome, self._failure = self._failure, None
        err = error_record(exc)
        err |= {"failures": outcome.failures if outcome else 0, "quarantined": outcome.quarantined if outcome else []}
        self.state.status.crashes += 1
        self.state.status.last_error = err
        self.state.ledger_status()
        if outcome is not None and outcome.quarantined:
            what = f"; its batch failed {outcome.failures} times: {len(outcome.quarantined)} trajectories quarantined"
        elif outcome is not None:
            what = f"; its batch failed {outcome.failures} of {self.state.ledger.after} times before quarantine"
        else:
            what = ""
        self.state.set_status("error", f"update failed: {err['type']}: {err['message'][:300]}{what}; restarting from the last checkpoint")
        log.error("learner update failed; exiting to restart from the last checkpoint", error=f"{err['type']}: {err['message']}", exc_info=exc)
        raise SystemExit(1) from exc

    # ---- one update ----------------------------------------------------------------------------
    def check_setup(self) -> None:
        """Refuse a configuration that cannot work, before any model is loaded (raises :class:`LearnerConfigError`).

        RTPO's and TCPO's re-rollouts replay task runs through the agent's runs endpoint and need its verifier:
        they need the learner's agent and that agent's task. LEAP's data engine needs the agent. (TCPO itself
        trains wherever rewards exist: without per-turn scores it falls back to the outcome.)"""
        if self._checked:
            return
        s = self.state.cfg.settings
        needs_task = s.rerollouts.enabled and s.trainer.estimator in ("rtpo", "tcpo")
        svr_runs = s.svr.enabled and s.svr.problems_per_update > 0
        engine = "[leap]" if s.leap.enabled else "[svr] runs" if svr_runs else "[reves]" if s.reves.enabled else None
        own = s.rollouts == "patr" or s.rods.enabled
        engine = engine or ("own rollouts (rollouts = 'patr', [rods])" if own else None)
        if (needs_task or engine) and self.state.cfg.agent is None:
            what = f"estimator {s.trainer.estimator!r} with re-rollouts" if needs_task else f"{engine} enabled"
            raise LearnerConfigError(f"{what} needs the learner's agent (--agent): its runs are what is replayed or expanded")
        sc = s.singletons
        if sc.mode == "complete" and sc.scorer == "hook" and sc.hook and not sc.hook.startswith(("http://", "https://")):
            from learner.group_completion import load_hook

            try:
                load_hook(sc.hook)
            except (ImportError, ValueError) as exc:
                raise LearnerConfigError(f"[singletons] hook {sc.hook!r} cannot be loaded: {exc}") from exc
        if own and self.state.task() is None:
            raise LearnerConfigError(f"rollouts = 'patr' and [rods] roll out task problems, but agent {self.state.cfg.agent!r} has no task")
        if s.rollouts == "patr" and needs_task:
            raise LearnerConfigError(
                "rollouts = 'patr' trains its trees in one step next to the live samples: use a one-step estimator, not rtpo/tcpo"
            )
        if needs_task and self.state.task() is None:
            raise LearnerConfigError(
                f"estimator {s.trainer.estimator!r} re-rolls task runs scored by a verifier, but agent {self.state.cfg.agent!r} has no task: "
                "give the agent a task, or set [rerollouts] enabled = false"
            )
        self._checked = True

    def _nothing_to_train(self, why: dict[str, Any], trainable: int = 0) -> str:
        """The status line of an update that found too little to train on: the top reason, and the experiment that holds serving.

        While an A/B experiment runs, users are served by its arms only, so once the trainer is more than
        ``max_staleness`` updates past them every new trajectory is stale and the learner waits for the decision."""
        have = f"{trainable} of {self.state.cfg.min_new_trajectories} trainable trajectories" if trainable else "nothing to train on"
        line = f"{have}: {why['top'] or 'no rewarded trajectories'}"
        if self.state.status.experiment is not None:
            line += f"; experiment {self.state.status.experiment} serves its arms until it decides"
        return line

    def update(self, force: bool = True, publish: bool = True) -> dict[str, Any]:
        """One update; with ``force=False`` nothing happens (no version, the data cursor kept) while fewer than
        ``min_new_trajectories`` trajectories are trainable (fresh, settled, rewarded).

        With ``publish=False`` (an experiment is running) a trained version is held: checkpointed, not
        published; ``tick`` publishes the newest held version once the experiment has decided.

        Between reading its batch and its checkpoint an update is in flight (``self.state.ledger``): an exception there counts
        against the batch, unless it is a stop or the runtime being away (module docstring: crashes)."""
        try:
            return self._update(force, publish)
        except (AdminError, httpx.HTTPError):
            self.state.ledger.interrupted()
            raise
        except Exception as exc:
            self._failure = self.state.ledger.failed(exc)
            self.state.ledger_status()
            raise
        except BaseException:  # SystemExit (a SIGTERM while orphaned), KeyboardInterrupt: a stop
            self.state.ledger.interrupted()
            raise

    def _update(self, force: bool, publish: bool) -> dict[str, Any]:
        self.check_setup()
        started = time.time()
        state = self.state
        trainer = state.get_trainer()
        resume = self._restart_or_resume(trainer)
        force = force or resume is not None  # half a sweep never waits for more data: its window is fixed
        made = self._data_engines(trainer)
        state.set_status("training", f"version {trainer.version + 1}")
        batch = self._read_batch(trainer, resume)
        trainable = len({s.trajectory_id for s in batch.samples})
        if not force and made.own is None and trainable < max(1, state.cfg.min_new_trajectories):  # own rollouts (PATR, RODS): no waiting
            # too few fresh trajectories (the rest stale, settling, unrewarded...): wait, keeping the cursor, rather than take a
            # full-size Adam step on a handful (Adam's step does not shrink with the batch: two noisy samples move the
            # weights as far as two hundred)
            return self._wait_for_more(trainer, batch, trainable)
        self.scheduler.short = None
        self._sample_ahead(trainer, made)
        state.ledger.begin(s.trajectory_id for s in batch.samples)  # until its checkpoint, a failure counts against this batch
        data_done = time.time()
        metrics, rerollouts, advantages, used = self.steps.train(trainer, batch.samples, batch.skipped, made.own)
        train_done = time.time()
        state.trained = used or batch.samples  # RTPO/TCPO steps report no one list: the parity probe picks among the live samples
        why = unused_reasons(batch.skipped, used, advantages, warmup=self.steps.warmup) | {"trained": metrics.trained_samples}
        trainer.cursor = self._cursor_after(trainer, batch, made, stepped=metrics.optimizer_step)
        self.scheduler.seen_since = batch.cursor.since
        trainer.save_checkpoint(state.dir / "checkpoints")
        state.ledger.done()
        state.ledger_status()
        (state.dir / RESTART_FILE).unlink(missing_ok=True)  # a restart from the champion is durable only from its first checkpoint on
        record: dict[str, Any] = {"version": trainer.version, "at": time.time(), "metrics": metrics.as_dict(), "unused": why}
        state.status.last_reasons = why
        if why["top"]:
            log.info("unused data", top_reason=why["top"], trained=why["trained"], **why["counts"])
        record |= self._reports(rerollouts, made, batch)
        if made.own is not None:
            state.status.sources = {k: v for k, v in made.own[2].items() if k != "patr"} | (
                {"patr": {k: v for k, v in made.own[2]["patr"].items() if k != "per_tree"}} if "patr" in made.own[2] else {}
            )
        state.status.version, state.status.updates, state.status.last_update_at = trainer.version, state.status.updates + 1, time.time()
        state.status.last_metrics = metrics.as_dict()
        saved = time.time()
        record["gate"] = self._publish_or_hold(trainer, why, stepped=metrics.optimizer_step, publish=publish)
        record["timings"] = update_timings(started, data_done, train_done, saved, time.time())
        with open(state.dir / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        plot_rewards(state.dir, state.family)
        return record

    def _restart_or_resume(self, trainer: Trainer) -> dict[str, Any] | None:
        """Where the update's weights start: the champion's after a requested restart; and the RTPO sweep to resume, if any."""
        restarts = self.state.status.restarts
        if self.state.restart:
            self.release.restart_from_champion(trainer)
        # an RTPO sweep a dead process left mid-way (its steps so far are in the checkpoint's weights) is resumed on the same
        # window; after a restart from the champion the weights are the pre-sweep ones again and the sweep starts over
        return self.steps.sweep_to_resume(trainer, restarted=self.state.status.restarts != restarts)

    def _engines_enabled(self) -> bool:
        s = self.state.cfg.settings
        return s.leap.enabled or (s.svr.enabled and s.svr.problems_per_update > 0) or s.reves.enabled or s.rollouts == "patr" or s.rods.enabled

    def _data_engines(self, trainer: Trainer) -> _EngineRuns:
        """The enabled data engines' runs (LEAP, SVR, REVES) and the learner's own rollouts, awaited until recorded: those
        sampled ahead during the last update's step (``overlap_sampling``) when they are for this update's problems, else
        sampled now from the trainer's current policy."""
        if not self._engines_enabled():
            return _EngineRuns(None, None, None, None)
        made = self._take_ahead(trainer)
        if made is None:
            made = self._run_engines(trainer, self.steps.rollout_model(trainer), announce=True)
        runs, recorded = made
        self.steps.await_recorded(recorded)
        return runs

    def _run_engines(self, trainer: EngineTrainer, model: str, *, announce: bool) -> tuple[_EngineRuns, list[str]]:
        """Each enabled engine once, for the problems ``trainer.cursor`` points at, sampling ``model``; and the ids of the
        runs whose recorded outcomes the update waits for."""
        settings = self.state.cfg.settings
        steps = self.steps
        leap = steps.leap_expand(trainer, model=model, announce=announce) if settings.leap.enabled else None
        svr_on = settings.svr.enabled and settings.svr.problems_per_update
        svr_runs = steps.svr_runs(trainer, model=model, announce=announce) if svr_on else None
        reves = steps.reves_round(trainer, model=model, announce=announce) if settings.reves.enabled else None
        own_on = settings.rollouts == "patr" or settings.rods.enabled
        own = steps.own_rollouts(trainer, model=model, announce=announce) if own_on else None
        own_runs = own[2].pop("trajectory_ids", []) if own is not None else []
        recorded = [*(svr_runs or {}).pop("trajectory_ids", []), *(reves or {}).pop("trajectory_ids", []), *own_runs]
        return _EngineRuns(leap, svr_runs, reves, own), recorded

    def _sample_ahead(self, trainer: Trainer, made: _EngineRuns) -> None:
        """With ``overlap_sampling``: start the next update's engine runs in a background thread, for the problems after
        this update's and from the policy before its step (the server samples while the trainer steps); the next update
        takes them if it starts where this one is expected to end (``_take_ahead``)."""
        if not (self.state.cfg.settings.overlap_sampling and self._engines_enabled()):
            return
        positions = self._engine_positions(trainer.cursor, made)
        nxt = _NextUpdate({**trainer.cursor, **positions}, trainer.version + 1, positions)
        try:
            model = self.steps.rollout_model(trainer)
        except (AdminError, httpx.HTTPError) as exc:  # the runtime is away: the next update samples its own, as without overlap
            log.warning("could not pick the policy to sample ahead from; the next update samples its own", error=str(exc))
            return
        done: Future[tuple[_EngineRuns, list[str]]] = Future()

        def work() -> None:
            try:
                done.set_result(self._run_engines(nxt, model, announce=False))
            except BaseException as exc:  # handed to the next update, which samples again
                done.set_exception(exc)

        threading.Thread(target=work, name=f"{self.state.family}-sampling-ahead", daemon=True).start()
        self._ahead = _Ahead(nxt, self.state.status.restarts, model, done)
        log.info("sampling the next update's runs during the step", model=model, for_version=nxt.version)

    def wait_for_ahead(self, timeout_s: float | None = None) -> None:
        """Wait until the runs being sampled ahead (if any) are made; they stay for the next update. A failure there is
        the next update's to report (it samples again)."""
        if self._ahead is not None:
            wait([self._ahead.done], timeout=timeout_s)

    def _take_ahead(self, trainer: Trainer) -> tuple[_EngineRuns, list[str]] | None:
        """The runs sampled ahead, once finished, if they are this update's: the trainer's cursor is at the engine positions
        they were sampled for (the last update ended as expected; with or without an optimizer step) and no restart from
        the champion came since. Otherwise (the last update failed, a restart, the sampling failed) None: this update
        samples its own, and the runs made ahead stay in the store like any traffic (within the staleness bound)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        self.state.set_status("expanding", f"waiting for the runs sampled ahead from {ahead.model}")
        try:
            made = ahead.done.result()
        except Exception as exc:
            log.warning("the runs sampled ahead failed; sampling this update's now", error=f"{type(exc).__name__}: {exc}")
            return None
        keys = ahead.at.positions
        if {k: trainer.cursor.get(k, 0) for k in keys} != keys or self.state.status.restarts != ahead.restarts:
            log.info("runs sampled ahead were for another start; sampling this update's now", sampled_for=ahead.at.version, version=trainer.version)
            return None
        return made

    def _read_batch(self, trainer: Trainer, resume: dict[str, Any] | None) -> _Batch:
        """The samples past the data cursor in the update's window (a resumed sweep's own window), self-check rewards applied."""
        state, settings = self.state, self.state.cfg.settings
        # the window's end and staleness floor, kept by a sweep's intermediate checkpoints: a resumed sweep reads the same batch
        floor = int(resume["min_version"]) if resume is not None and "min_version" in resume else self.scheduler.staleness_floor(trainer)
        now = float(resume["now"]) if resume is not None and "now" in resume else time.time()
        state.window = {"now": now, "min_version": floor}
        batch = collect_samples(
            state.store,
            family=state.family,
            min_version=floor,
            now=now,
            cursor=Cursor.from_dict(trainer.cursor),
            cfg=settings.samples,
            traffic=state.traffic,
            exclude=state.ledger.quarantined(),
        )
        skipped = batch.counts.as_dict()
        samples, self_check_rewards = apply_self_check_rewards(batch.samples, settings.svr, settings.svr_r1)
        skipped["svr_adaptive"], skipped["self_check_unmeasured"] = self_check_rewards["adaptive"], self_check_rewards["unmeasured"]
        return _Batch(samples, skipped, batch.cursor, self_check_rewards)

    def _wait_for_more(self, trainer: Trainer, batch: _Batch, trainable: int) -> dict[str, Any]:
        """An update that trains nothing yet: the status says why, the scheduler how many trajectories are missing."""
        state = self.state
        why = unused_reasons(batch.skipped, [], [])
        state.status.last_reasons = why
        state.set_status("waiting", self._nothing_to_train(why, trainable))
        self.scheduler.short = (state.status.new_trajectories, max(1, state.cfg.min_new_trajectories - trainable))
        reason = "no samples" if not batch.samples else f"{trainable} trainable trajectories, fewer than {state.cfg.min_new_trajectories}"
        return {"version": trainer.version, "at": time.time(), "metrics": {}, "gate": {"decision": "skipped", "reason": reason}}

    def _cursor_after(self, trainer: Trainer, batch: _Batch, made: _EngineRuns, *, stepped: bool) -> dict[str, Any]:
        """The trainer's cursor after this update: the data cursor past the batch, the versions that bound staleness, the
        data engines' next problems and items, the singleton baselines."""
        keep = self.state.cfg.settings.samples.max_staleness + 1
        baseline = self.steps.baseline_state if self.steps.baseline_state is not None else trainer.cursor.get(BASELINE, {})
        return {
            **batch.cursor.to_dict(),
            # an update without an optimizer step made no new version: it does not move the staleness bound either
            UPDATE_VERSIONS: ([*update_versions(trainer), trainer.version] if stepped else update_versions(trainer))[-keep:],
            LINEAGE_START: int(trainer.cursor.get(LINEAGE_START, 0)),
            BASELINE: baseline,
            **self._engine_positions(trainer.cursor, made),
        }

    def _engine_positions(self, cursor: dict[str, Any], made: _EngineRuns) -> dict[str, Any]:
        """Where the data engines start after an update that made ``made`` from ``cursor``: LEAP's, SVR's and REVES's next
        problems or items, PATR's next tree (RODS keeps its own pool)."""
        settings = self.state.cfg.settings
        leap_next = int(cursor.get(LEAP_NEXT, 0)) + (settings.leap.problems_per_update if made.leap is not None else 0)
        svr_next = int(made.svr_runs["problems"][1]) if made.svr_runs is not None else int(cursor.get(SVR_NEXT, 0))
        reves_next = int(made.reves["items"][1]) if made.reves is not None else int(cursor.get(REVES_NEXT, 0))
        sources = self.steps.sources
        own_next = sources.cursor_after(cursor) if made.own is not None and sources is not None else {}  # PATR's next problem (RODS off)
        return {LEAP_NEXT: leap_next, SVR_NEXT: svr_next, REVES_NEXT: reves_next, **own_next}

    def _reports(self, rerollouts: dict[str, Any] | None, made: _EngineRuns, batch: _Batch) -> dict[str, Any]:
        """The history record's reports of what fed the step: re-rollouts or group completion, the data engines, the
        self-check rewards, the own rollouts."""
        settings = self.state.cfg.settings
        reports: dict[str, Any] = {}
        if rerollouts is not None:
            reports["group_completion" if "completed_groups" in rerollouts or "group_completion" in rerollouts else "rerollouts"] = rerollouts
        if made.leap is not None:
            reports["leap"] = made.leap
        if made.svr_runs is not None:
            reports["svr_runs"] = made.svr_runs
        if made.reves is not None:
            reports["reves"] = made.reves
        if settings.svr.enabled or settings.svr_r1.enabled:
            reports["self_check_rewards"] = batch.self_check_rewards
        if made.own is not None:
            reports["sources"] = made.own[2]
        return reports

    def _publish_or_hold(self, trainer: Trainer, why: dict[str, Any], *, stepped: bool, publish: bool) -> dict[str, Any]:
        """The update's ``gate`` record: the new version published and gated, held while an experiment runs, or, without an
        optimizer step, skipped."""
        state = self.state
        if stepped and publish:
            state.held = False
            return self.release.publish_and_gate(trainer)
        if stepped:
            state.held = True
            gate = {"decision": "held", "reason": f"experiment {state.status.experiment} is running: published once it decides"}
            state.set_status("ab", f"version {trainer.version} trained, held until experiment {state.status.experiment} decides")
            return gate
        reason = why["top"] or "no samples"
        state.set_status("idle", f"version {trainer.version}: nothing learned; top reason: {reason}")
        return {"decision": "skipped", "reason": f"no optimizer step: {reason}"}

    def _restore_cursor(self) -> None:
        """Where the data window starts, without loading the model: the newest checkpoint's cursor."""
        from learner.trainer import list_checkpoints, read_checkpoint_meta

        ckpts = list_checkpoints(self.state.dir / "checkpoints") if (self.state.dir / "checkpoints").is_dir() else []
        if ckpts:
            meta = read_checkpoint_meta(ckpts[-1])
            self.state.status.version = int(meta.get("version", 0))
            self.scheduler.seen_since = float(Cursor.from_dict(meta.get("cursor")).since)
            sweep = (meta.get("cursor") or {}).get(RTPO_SWEEP)
            if isinstance(sweep, dict):
                log.info(
                    "an RTPO sweep was interrupted; the next update resumes it",
                    version=self.state.status.version,
                    steps_done=sweep.get("done"),
                    of=len(sweep.get("segments") or []),
                )
        else:
            self.scheduler.seen_since = 0.0


@dataclass
class _EngineRuns:
    """What the data engines and the learner's own rollouts made before the batch is read (None: not run this update)."""

    leap: dict[str, Any] | None
    svr_runs: dict[str, Any] | None
    reves: dict[str, Any] | None
    own: tuple[list[Sample], Advantages, dict[str, Any]] | None  # PATR's tree samples with their advantages, and the figures


@dataclass(frozen=True)
class _NextUpdate:
    """The trainer as the next update will start it, for the engines sampling ahead: its cursor with the engine positions
    moved past this update's runs, and the version after this update's step (the sampling seeds' base)."""

    cursor: dict[str, Any]
    version: int
    positions: dict[str, Any]  # the cursor's engine positions (``_engine_positions``)


@dataclass
class _Ahead:
    """Runs sampled ahead in a background thread (``overlap_sampling``): for which start, after which restart count, from
    which policy, and the thread's result."""

    at: _NextUpdate
    restarts: int
    model: str
    done: Future[tuple[_EngineRuns, list[str]]]


@dataclass
class _Batch:
    """An update's batch: the samples past the data cursor (self-check rewards applied), the skip counts, the cursor past
    the batch, the self-check rewards' counts."""

    samples: list[Sample]
    skipped: dict[str, int]
    cursor: Cursor
    self_check_rewards: dict[str, Any]
