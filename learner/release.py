"""Releasing a trained version: publish, load, parity probe, eval gate, champion and A/B, and rejections.

``Release`` is the learner service's release job (one object over the service's shared ``ServiceState``).
``publish_and_gate`` publishes ``family@N`` (through ``learner.update.checkpoint_and_publish``, the one publish path
of every trainer), loads it into the runtime, probes logprob parity (``learner/parity.py``) while the held-out eval
gate runs against the champion through the runs endpoint (fixed problems and seeds: a model's runs are kept by name,
so a champion is run once, not at every gate; a version the probe refuses abandons its gate), and then makes the
first passing version the champion (alias) or starts an A/B experiment against the champion. ``experiment_running``
follows that experiment to its decision; a version refused by the parity probe or the gate, or rolled back, is
rejected: with ``restart_from_champion`` the next update starts from the champion's weights
(``restart_from_champion``). ``publish_intermediate`` publishes an RTPO sweep's step for its next re-rollouts
(parity probe, no eval gate, no alias; a refused one is unloaded and raises ``learner.parity.ParityRefused``);
``publish_held`` releases a version trained while an experiment ran.

Not here: the publish protocol and the admin client (``learner/publish.py``), the experiment's statistics
(the runtime's ``runtime/adapters/experiments.py``), when a release happens (``learner/scheduler.py``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import structlog

from learner.parity import refusal
from learner.publish import AdminError, adapter_path
from learner.reward_plot import plot_rewards
from learner.samples import Sample
from learner.service_state import (
    CHAIN_FILE,
    INTERMEDIATE,
    LINEAGE_START,
    RESTART_FILE,
    UPDATE_VERSIONS,
    ServiceState,
    update_timings,
    update_versions,
)
from learner.svr_rollouts import adaptive_report
from learner.update import Trainer, checkpoint_and_publish

log = structlog.get_logger(__name__)


class GateAbandoned(RuntimeError):
    """The gate of a version the parity probe refused stopped sending its runs."""


class Release:
    """Publish, gate, champion and A/B: the learner service's release job (module docstring)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        # a model's gate runs, by model name: the gate's problems and sampling seeds are fixed (``gate_seed``) and a name
        # (``family@N``, the base model) is one set of weights, so a champion's runs are not made again at every gate
        self._gate_cache: OrderedDict[tuple[str, str | None, int, int], list[dict[str, Any]]] = OrderedDict()

    def publish_held(self) -> None:
        """Publish and gate the version trained while an experiment ran (one history line, no new metrics)."""
        trainer = self.state.get_trainer()
        self.state.held = False
        started = time.time()
        record: dict[str, Any] = {"version": trainer.version, "at": started, "metrics": {}, "held": True}
        record["gate"] = self.publish_and_gate(trainer)
        record["timings"] = update_timings(started, started, started, started, time.time())  # a release only
        with open(self.state.dir / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        plot_rewards(self.state.dir, self.state.family)

    def publish_current(self, trainer: Trainer, meta: dict[str, Any] | None = None) -> str:
        """Publish (once, through ``learner.update.checkpoint_and_publish``) and load the trainer's current weights as
        ``family@N`` without an alias; its checkpoint was written by the update that made it. Without ``meta``: the held
        version, for the learner's own runs while an experiment runs (``RolloutSteps.rollout_model``), and
        ``publish_and_gate`` later releases the same folder (version N has one set of weights)."""
        if adapter_path(self.state.adapter_root, self.state.family, trainer.version).exists():
            return self.state.ensure_loaded(trainer.version)
        meta = meta or {INTERMEDIATE: True, "held": True}
        return checkpoint_and_publish(trainer, None, self.state.adapter_root, self.state.family, meta=meta, admin=self.state.admin).name

    def publish_intermediate(self, trainer: Trainer, candidates: Sequence[Sample] | None = None) -> str:
        """Checkpoint, publish and load the trainer's current weights for the next step's re-rollouts (no eval gate, no alias),
        then probe its logprob parity (``candidates``: the sweep's samples, where the probe picks its turns; default the
        last update's).

        The checkpoint comes first and keeps the update's old data cursor and the sweep's progress (``rtpo_sweep``): a
        learner killed after it resumes the sweep at the next step from this version (never publishing it a second time
        with other weights, never re-applying a step; ``RolloutSteps``' RTPO sweep).
        A version the probe refuses is unloaded, joins the rejected names and raises :class:`learner.parity.ParityRefused`:
        nothing may be sampled from it (the sweep goes on with the policy it sampled from before)."""
        ckpt = self.state.dir / "checkpoints"
        published = checkpoint_and_publish(
            trainer, ckpt, self.state.adapter_root, self.state.family, meta={INTERMEDIATE: True}, admin=self.state.admin
        )
        return self.probe_intermediate(trainer, published.name, candidates)

    def probe_intermediate(self, trainer: Trainer, name: str, candidates: Sequence[Sample] | None) -> str:
        """Probe a loaded intermediate version's parity; a refused one is unloaded, joins the rejected names and raises
        :class:`learner.parity.ParityRefused`. Returns ``name`` when it passes."""
        from learner.parity import ParityRefused, refusal

        report = self.parity(trainer, name, candidates=candidates, intermediate=True)
        reason = refusal(report, self.state.cfg.settings.parity.threshold)
        if reason is not None:
            assert report is not None
            self.state.unload(name)
            self.state.rejected_names.add(name)
            log.warning("an intermediate version was refused by the parity probe", version=name, reason=reason)
            raise ParityRefused(name, reason, report)
        return name

    def publish_and_gate(self, trainer: Trainer) -> dict[str, Any]:
        version = trainer.version
        self.state.set_status("publishing", f"{self.state.family}@{version}")
        new = self.publish_current(trainer, meta={"metrics": self.state.status.last_metrics})
        champion = self.state.champion()
        # the gate's runs (the server's work) go on while the probe decodes and the trainer scores: a probe took 13-21 s of
        # a demo release before the gate began. A version the probe refuses abandons its gate (runs not yet sent are not).
        abandon = threading.Event()
        self.state.set_status("probing", f"logprob parity of {new} (and its gate, where one is configured)")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gate") as pool:
            gating = pool.submit(self.gate, new, champion, abandon)
            try:
                parity = self.parity(trainer, new, status=False)  # the status says "gating" while both run
            except BaseException:
                abandon.set()
                raise
            refused = refusal(parity, self.state.cfg.settings.parity.threshold)
            if refused is not None:
                abandon.set()
            try:
                gate = gating.result()
            except Exception:
                if refused is None:
                    raise
                gate = {}  # abandoned (or failed) for a version that is refused anyway
        if parity is not None and refused is not None:
            gate = {
                "decision": "refused",
                "reason": refused,
                "new": new,
                "parity": parity,
            }
            self.state.status.last_gate = gate
            self.state.unload(new)
            self._rejected(new, "refused by the parity probe")
            return gate
        if parity is not None:
            gate["parity"] = parity
        self.state.status.last_gate = gate
        if gate["decision"] == "refused":
            self.state.unload(new)
            self._rejected(new, "refused by the eval gate")
        elif champion is None:
            self.state.admin.set_alias(self.state.family, new)
            self.state.status.champion = new
            self.state.set_status("idle", f"{new} is the first champion")
        else:
            name = f"{self.state.family}-v{version}"
            self.state.admin.create_experiment(self._experiment_config(name, champion, new))
            self.state.status.experiment, self.state.status.challenger = name, new
            self.state.set_status("ab", f"experiment {name}: {champion} vs {new}")
        return gate

    def parity(
        self, trainer: Trainer, model: str, candidates: Sequence[Sample] | None = None, *, intermediate: bool = False, status: bool = True
    ) -> dict[str, Any] | None:
        """The logprob parity probe of a just-loaded version (``learner/parity.py``): its greedy, sampled and constrained
        turns, picked among ``candidates`` (default: the last update's trained samples) the first time; None when it is
        off or has no turns yet."""
        from learner.parity import parity_probe, probe_turns

        pc = self.state.cfg.settings.parity
        if not pc.enabled:
            return None
        probe = probe_turns(self.state.dir, self.state.store, self.state.trained if candidates is None else candidates, pc.turns)
        if not probe:
            return None
        what = ", ".join(f"{len(ids)} {kind}" for kind, ids in probe.items())
        if status:
            self.state.set_status("probing", f"logprob parity of {model} on recorded turns ({what})")
        headers = {"Authorization": f"Bearer {self.state.cfg.admin_key}"}
        with httpx.Client(base_url=self.state.cfg.admin_url, headers=headers, timeout=300) as client:
            report = parity_probe(client, self.state.store, trainer, model=model, probe=probe, max_tokens=pc.max_tokens)
        report["model"] = model
        if intermediate:
            report["intermediate"] = True
        self.state.status.last_parity = report
        log.info("parity probe", **report)
        return report

    def _experiment_config(self, name: str, champion: str, new: str) -> dict[str, Any]:
        """The A/B experiment of a new version against the champion, judged by the evidence the learner trains on.

        An agent's task is judged by its verifier's outcome (``verifier:<task>``, the source that ranks first for its runs);
        any other learner (chat traffic) by its own ``[samples] reward_sources`` rule, whatever a client names its
        feedback source. Both count only the owners it trains on, bounded by the same ``max_owner_share``, never the
        learner's own runs (the runtime leaves out everything done through the admin API), and end undecided after
        ``ab_max_duration_s``, so an experiment that collects no evidence never holds the learner forever; undecided, the
        new version is promoted if shown non-inferior (``ab_non_inferiority_margin``), else the champion stays. The margin
        bounds the chain: the promotions since the first champion (``_chain``) are the test's prior, so the served line
        never drifts more than the margin below where it started, however many small steps it takes."""
        sc = self.state.cfg.settings.samples
        task = self.state.task()
        rule: dict[str, Any] = {"metric": f"verifier:{task}"} if task else {"reward_sources": list(sc.reward_sources)}
        return {
            "name": name,
            "family": self.state.family,
            "arms": [{"adapter": champion, "weight": 1}, {"adapter": new, "weight": 1}],
            "sticky": "session",
            **rule,
            "owners": list(sc.owners) if sc.owners is not None else None,
            "max_owner_share": sc.max_owner_share,
            "max_duration_s": self.state.cfg.settings.ab_max_duration_s,
            "non_inferiority_margin": self.state.cfg.settings.ab_non_inferiority_margin,
            "non_inferiority_chain": self._chain(champion),
            "min_samples": self.state.cfg.ab_min_samples,
            "max_samples": self.state.cfg.ab_max_samples,
            "auto_promote": True,
            "auto_rollback": True,
        }

    def _chain(self, champion: str) -> dict[str, Any]:
        """The chain of promotions this learner's experiments made since its anchor (the first champion they started from):
        their effects summed in pooled sds (``chain.json`` in the learner's folder; the status shows it)."""
        try:
            chain = json.loads((self.state.dir / CHAIN_FILE).read_text())
        except (OSError, ValueError):
            chain = {}
        if not isinstance(chain, dict) or not chain.get("anchor"):
            chain = {"anchor": champion, "steps": 0, "diff_sd": 0.0, "var_sd": 0.0}
        self.state.status.chain = chain
        return {k: chain[k] for k in ("anchor", "steps", "diff_sd", "var_sd")}

    def _extend_chain(self, exp: dict[str, Any]) -> None:
        """A promotion adds its ``effect`` (the runtime's estimate of new minus champion, in pooled sds) to the chain."""
        effect, winner = exp.get("effect"), exp.get("winner")
        if exp.get("status") != "promoted" or not isinstance(effect, dict) or effect.get("arm") != winner:
            return
        chain = self._chain(str(exp.get("champion")))
        if self.state.status.chain.get("experiment") == exp.get("name"):
            return  # counted already (a learner restarted after reading the experiment's end)
        chain.update(
            experiment=exp.get("name"),
            steps=int(chain["steps"]) + 1,
            diff_sd=float(chain["diff_sd"]) + float(effect["diff_sd"]),
            var_sd=float(chain["var_sd"]) + float(effect["var_sd"]),
            last=winner,
        )
        (self.state.dir / CHAIN_FILE).write_text(json.dumps(chain))
        self.state.status.chain = chain
        log.info("promotion chain", **chain)

    def _rejected(self, version: str, why: str) -> None:
        """A version was refused or rolled back: with ``restart_from_champion`` the next update starts from the champion."""
        restart = self.state.cfg.settings.restart_from_champion
        self.state.restart = restart
        self.state.rejected_names.add(version)
        self._gate_cache.pop(self._gate_key(version), None)  # its gate runs, if kept: a rejected name is never gated again
        if restart:
            (self.state.dir / RESTART_FILE).touch()
        self.state.set_status("idle", f"{version} {why}" + ("; the next update starts from the champion's weights" if restart else ""))

    def gate(self, new: str, champion: str | None, abandon: threading.Event | None = None) -> dict[str, Any]:
        """Held-out success of the new version vs the champion (or the base model), through the runs endpoint. ``abandon``
        set (the parity probe refused ``new``) stops sending its runs: :class:`GateAbandoned`, nothing kept."""
        if self.state.cfg.agent is None or self.state.cfg.gate_n <= 0:
            return {"decision": "passed", "reason": "no gate configured"}
        self.state.set_status("gating", f"{new} vs {champion or 'base'} on {self.state.cfg.gate_n} held-out problems")
        base = self.state.base_model_name()
        old = champion or base
        reused = self._gate_key(old) in self._gate_cache
        new_runs, old_runs = asyncio.run(self._gate_arms([new, old], abandon))
        new_rate = sum(bool(r.get("correct")) for r in new_runs) / len(new_runs)
        old_rate = sum(bool(r.get("correct")) for r in old_runs) / len(old_runs)
        passed = new_rate >= old_rate - self.state.cfg.gate_tolerance
        return {
            "decision": "passed" if passed else "refused",
            "new": new,
            "champion": champion or base,
            "new_success": new_rate,
            "champion_success": old_rate,
            "tolerance": self.state.cfg.gate_tolerance,
            "n": self.state.cfg.gate_n,
            "champion_runs": "reused" if reused else "run",  # the same problems and seeds as its earlier gate: not run again
            # the adaptive agent's figures (mean turns, wrong-stop rate, ECE of its stated confidence): learner/svr_rollouts.py
            "new_report": adaptive_report(new_runs),
            "champion_report": adaptive_report(old_runs),
        }

    def _gate_key(self, model: str) -> tuple[str, str | None, int, int]:
        return (model, self.state.task(), self.state.cfg.gate_seed, self.state.cfg.gate_n)

    async def _gate_arms(self, models: Sequence[str], abandon: threading.Event | None = None) -> list[list[dict[str, Any]]]:
        """Each model's runs of the gate's ``gate_n`` problems (problem seed ``gate_seed``, which is also every run's
        sampling seed, so the arms are paired). A model whose runs are kept from an earlier gate is not run again; the
        others run together, problems interleaved, so the server batches them."""
        todo = [m for m in dict.fromkeys(models) if self._gate_key(m) not in self._gate_cache]
        if todo:
            made = await self._gate_runs(todo, abandon)
            for m, r in zip(todo, made, strict=True):
                self._gate_cache[self._gate_key(m)] = r
        for m in models:
            self._gate_cache.move_to_end(self._gate_key(m))  # least recently read first
        while len(self._gate_cache) > 8:  # a champion's runs stay while it is the champion (read at each gate)
            self._gate_cache.popitem(last=False)
        return [self._gate_cache[self._gate_key(m)] for m in models]

    async def _gate_runs(self, models: Sequence[str], abandon: threading.Event | None = None) -> list[list[dict[str, Any]]]:
        headers = {"Authorization": f"Bearer {self.state.cfg.admin_key}"}
        task = self.state.task()
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=self.state.cfg.admin_url, headers=headers, timeout=900) as client:

            async def one(model: str, i: int) -> dict[str, Any]:
                body: dict[str, Any] = {"problem_index": i, "seed": self.state.cfg.gate_seed, "model": model, "eval": True}
                if task:
                    body["task"] = task
                async with sem:
                    if abandon is not None and abandon.is_set():
                        raise GateAbandoned(model)
                    r = await client.post(f"/admin/agents/{self.state.cfg.agent}/runs", json=body)  # the admin API's runs: owned by "admin"
                r.raise_for_status()
                out: dict[str, Any] = r.json()
                return out

            n = self.state.cfg.gate_n
            done = await asyncio.gather(*(one(m, i) for i in range(n) for m in models))
            return [list(done[k :: len(models)]) for k in range(len(models))]

    def experiment_running(self, name: str) -> bool:
        try:
            exp = self.state.admin.experiment_status(name)
        except AdminError as exc:
            if exc.status == 404:
                return False
            raise
        if exp.get("status") == "running":
            return True
        # a promotion's winner is the champion now; "champion" is the one the experiment started with
        self.state.status.champion = exp.get("winner") or exp.get("champion") or self.state.status.champion
        self._extend_chain(exp)
        challenger, self.state.status.experiment, self.state.status.challenger = self.state.status.challenger, None, None
        if exp.get("status") == "rolled_back" and challenger is not None:
            if self.state.held and self.state.cfg.settings.restart_from_champion:
                self.state.held = False  # trained on from the rolled-back version: that line is dropped
                log.info("dropping the version held during the experiment: it descends from the rolled-back one", rolled_back=challenger)
            self._rejected(challenger, "was rolled back by its experiment")
        return False

    def restart_from_champion(self, trainer: Trainer) -> None:
        """Load the champion's published LoRA (the base model's identity LoRA before any champion), fresh optimizer.

        The trainer's line becomes the champion's: the update versions after the champion's (the rejected line) leave
        ``trainer.cursor``, so the staleness bound counts from the champion again and the traffic it serves trains.
        The restart marker stays until the next checkpoint (``LearnerService.update``), so a learner killed before it
        restarts from the champion again instead of resuming the rejected line's checkpoint."""
        from safetensors.torch import load_file

        self.state.restart = False
        champion = self.state.champion()
        weights, version = None, 0
        if champion is not None:
            _, _, v = champion.partition("@")
            version = int(v)
            folder = adapter_path(self.state.adapter_root, self.state.family, version)
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                log.warning("the champion's adapter files are missing; continuing from the trainer's own weights", champion=champion)
                return
            weights = load_file(str(files[0]))
        trainer.restart_from(weights)
        line = [x for x in update_versions(trainer) if x < version] + [version]  # the champion's own updates (as far as kept), then it
        trainer.cursor = {**trainer.cursor, UPDATE_VERSIONS: line, LINEAGE_START: line[0]}
        self.state.status.restarts += 1
        log.info("restarted from the champion", champion=champion or "base", version=trainer.version)
