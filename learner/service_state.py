"""What the learner service's jobs share: its configuration, its status, and the state and helpers they all use.

``ServiceConfig`` (what ``python -m learner run`` and ``serve.py`` pass in), ``Status`` (what
``GET /admin/learner`` shows, written to ``status.json`` by ``ServiceState.set_status``; a restarted learner keeps its
predecessor's last error and crash count, :func:`carried_over`), the file and cursor keys,
and ``ServiceState``: one object, made by ``LearnerService`` and handed to its jobs in ``learner/scheduler.py``,
``learner/rollout_steps.py`` and ``learner/release.py``, that holds the handles they use (store, runtime admin,
status, ledger), the typed trainer (``learner.update.Trainer``, built on first use), the state one job leaves for
another, and the small queries of the runtime they all make (the champion, the agent's task, the base model's name,
the newest published version).

Not here: any job itself (scheduling, training, publishing); those modules hold them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from learner.config import LearnerSettings, TrafficFilter, schedule_default
from learner.publish import AdminError, RuntimeAdmin, adapter_path
from learner.quarantine import BatchLedger
from learner.records.adapter_manifest import manifest_sha256
from learner.records.store import db_path
from learner.records.store_open import open_store
from learner.samples import Sample
from learner.update import Trainer

log = structlog.get_logger(__name__)

REQUEST_FILE = "update.request"
CHAIN_FILE = "chain.json"  # the promotions since the first champion, summed in pooled sds (release.py: chained non-inferiority)
RESTART_FILE = "restart.request"  # a version was rejected: the next update starts from the champion (survives a learner restart)
INTERMEDIATE = "rtpo_intermediate"  # manifest key of versions published only for an RTPO sweep's siblings
UPDATE_VERSIONS = "update_versions"  # trainer.cursor key: the final version of each recent update (the staleness bound)
LINEAGE_START = "lineage_start"  # trainer.cursor key: the oldest version known on the current weights' line (set by a restart)
LEAP_NEXT = "leap_next_problem"  # trainer.cursor key: the next problem index LEAP's data engine probes
SVR_NEXT = "svr_next_problem"  # trainer.cursor key: the next training problem of SVR's fixed-horizon runs
REVES_NEXT = "reves_next_item"  # trainer.cursor key: the next training item REVES augments
BASELINE = "singleton_baseline"  # trainer.cursor key: the running baselines of one-off prompts (learner/baseline.py)
RTPO_SWEEP = "rtpo_sweep"  # trainer.cursor key: an unfinished RTPO sweep's progress, in each intermediate checkpoint (rollout_steps.py)


class LearnerConfigError(ValueError):
    """The learner's settings cannot work with this runtime (e.g. re-rollouts for an agent without a task)."""


def learner_dir(data_dir: Path, family: str) -> Path:
    return Path(data_dir) / "learner" / family


CARRIED = ("last_error", "crashes")  # what a restarted learner keeps of its predecessor's status


def carried_over(folder: Path) -> dict[str, Any]:
    """The fields of ``CARRIED`` from the status the previous learner process of ``folder`` left (empty when none is readable)."""
    try:
        old = json.loads((folder / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: old[k] for k in CARRIED if isinstance(old, dict) and old.get(k) is not None}


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
    # the schedule: declared (defaults, bounds, meaning) once, in learner.config.ScheduleConfig
    min_new_trajectories: int = schedule_default("min_new_trajectories")
    poll_s: float = schedule_default("poll_s")
    gate_n: int = schedule_default("gate_n")
    gate_seed: int = schedule_default("gate_seed")
    gate_tolerance: float = schedule_default("gate_tolerance")
    ab_min_samples: int = schedule_default("ab_min_samples")
    ab_max_samples: int | None = schedule_default("ab_max_samples")  # None = no cap
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
    chain: dict[str, Any] = field(default_factory=dict)  # promotions since the anchor: anchor, steps, diff_sd, var_sd (release.py)
    restarts: int = 0  # times the trainer restarted from the champion after a rejected version
    traffic: dict[str, Any] = field(default_factory=dict)  # the traffic filter this learner trains on
    sources: dict[str, Any] = field(default_factory=dict)  # the last update's own rollouts: PATR budget, RODS pool figures
    # supervision (learner/quarantine.py; serve.py's restarts are in supervisor.json, merged in by GET /admin/learner)
    last_error: dict[str, Any] | None = None  # the last crash: type, message, traceback (last lines), at, failures of its batch
    crashes: int = 0  # updates that raised and processes that died mid-update, counted across restarts of the learner
    failing_batch: dict[str, Any] | None = None  # a batch that failed once and is retried: trajectories, suspects, failures, since
    quarantine: dict[str, Any] = field(default_factory=dict)  # quarantined trajectories: count, batches, the newest (ids, when, why)
    resumed: dict[str, Any] | None = None  # the last RTPO sweep this process resumed mid-way: step, of, version, start_version, at
    pid: int = field(default_factory=os.getpid)
    updated_at: float = field(default_factory=time.time)


class ServiceState:
    """What the learner service and its jobs share: the handles (configuration, store, runtime admin, status, ledger),
    the trainer (built on first use), the state one job leaves for another, and the queries of the runtime they all make.

    One instance per learner process, made by ``LearnerService`` and handed to each job (``Scheduler``, ``RolloutSteps``,
    ``Release``)."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.family = cfg.settings.family
        self.dir = learner_dir(cfg.data_dir, self.family)  # checkpoints, history.jsonl, status.json, reward.png
        self.dir.mkdir(parents=True, exist_ok=True)
        self.adapter_root = cfg.adapter_root or Path(cfg.data_dir) / "adapters"
        # the interaction store (SQLite or PostgreSQL: learner/records/store.py, learner/records/store_pg.py)
        self.store: Any = open_store(cfg.store or db_path(cfg.data_dir))
        self.admin = RuntimeAdmin(cfg.admin_url, cfg.admin_key)
        s = cfg.settings.traffic
        # --agent names the one agent this learner trains (and gates) on; otherwise the [traffic] table decides
        self.traffic = TrafficFilter(chat=False, agents=[cfg.agent], models=s.models, tags=s.tags) if cfg.agent else s
        self.status = Status(self.family, traffic=self.traffic.model_dump(), **carried_over(self.dir))
        self.ledger = BatchLedger(self.dir)  # the in-flight marker and the quarantine (learner/quarantine.py)
        self.trainer: Trainer | None = None  # built by the first ``get_trainer``: idle learners hold no model
        self.restart = (self.dir / RESTART_FILE).exists()  # a version was rejected: the next update starts from the champion's weights
        self.rejected_names: set[str] = set()  # versions refused or rolled back: never used for re-rollouts
        self.held = False  # a version trained during an experiment waits to be published
        self._status_lock = threading.Lock()
        self.trained: list[Sample] = []  # the last update's samples (the parity probe picks its turns among them)
        # this update's sample window: "now" and "min_version" as collect_samples read them (a resumed sweep's)
        self.window: dict[str, Any] = {}

    def get_trainer(self) -> Trainer:
        """The trainer, built (and resumed from the newest checkpoint) on the first call."""
        if self.trainer is None:
            from learner.collectives import world
            from learner.distributed import RankZeroTrainer
            from learner.trainer import LoRATrainer  # torch + peft: only once there is something to train

            s = self.cfg.settings
            # with --nproc N, the workers build, resume and step in lockstep with this trainer (learner/distributed.py)
            trainer: Trainer = (
                RankZeroTrainer(self.cfg.base_model, s.trainer, s.lora) if world()[1] > 1 else LoRATrainer(self.cfg.base_model, s.trainer, s.lora)
            )
            if trainer.load_checkpoint(self.dir / "checkpoints") is not None:
                log.info("resumed from checkpoint", version=trainer.version)
            self.trainer = trainer
        return self.trainer

    def published_version(self) -> int:
        """The family's newest published version (0 before the first): what the runtime may be serving."""
        versions = [int(p.name[1:]) for p in (self.adapter_root / self.family).glob("v*") if p.name[1:].isdigit()]
        return max(versions, default=0)

    def task(self) -> str | None:
        """The gate's and the A/B metric's task: configured, else the agent's own."""
        if self.cfg.task is None and self.cfg.agent is not None:
            agents = self.admin._call("GET", "/admin/agents", idempotent=True).get("data", [])
            self.cfg.task = next((a.get("task") for a in agents if a.get("name") == self.cfg.agent), None)
        return self.cfg.task

    def champion(self) -> str | None:
        aliases = self.admin.list_adapters().get("aliases", {})
        target = aliases.get(self.family)
        return target if isinstance(target, str) else None

    def base_model_name(self) -> str:
        r = httpx.get(f"{self.cfg.admin_url}/ready", timeout=30)
        r.raise_for_status()
        return str(r.json()["model"])

    def ensure_loaded(self, version: int) -> str:
        """``family@version`` (published) loaded into the runtime unless it already is; its name."""
        name = f"{self.family}@{version}"
        if name not in {a["name"] for a in self.admin.list_adapters().get("data", [])}:
            path = adapter_path(self.adapter_root, self.family, version)
            self.admin.load(path, self.family, version, sha256=manifest_sha256(path))
        return name

    def unload(self, name: str) -> None:
        try:
            self.admin._call("DELETE", f"/admin/adapters/{name}", idempotent=True)
        except AdminError as exc:
            log.warning("could not unload a refused version", adapter=name, error=str(exc))

    def ledger_status(self) -> None:
        """The quarantine and a failing batch, as the ledger files say, into the status (written by the next ``set_status``)."""
        self.status.quarantine = self.ledger.summary()
        self.status.failing_batch = self.ledger.pending()

    def set_status(self, state: str, detail: str) -> None:
        """Set the status's state and detail and write ``status.json`` (atomically)."""
        with self._status_lock:  # the release's gate and parity probe run in two threads
            self.status.state, self.status.detail, self.status.updated_at = state, detail, time.time()
            tmp = self.dir / "status.json.tmp"
            tmp.write_text(json.dumps(asdict(self.status)))
            os.replace(tmp, self.dir / "status.json")


def update_timings(started: float, data_done: float, train_done: float, saved: float, done: float) -> dict[str, Any]:
    """Where an update's time went (its history line's ``timings``), from the times it passed each stage: its data (the
    learner's own runs included), the step (re-rollouts included), the checkpoint and bookkeeping, and the release
    (publish, parity probe, gate; about 0 for a held version)."""
    return {
        "started_at": started,
        "data_s": data_done - started,
        "train_s": train_done - data_done,
        "checkpoint_s": saved - train_done,
        "release_s": done - saved,
        "total_s": done - started,
    }


def update_versions(trainer: Trainer) -> list[int]:
    """The trainer's version at the end of each of the last updates (oldest first), as its checkpoint keeps them."""
    v = trainer.cursor.get(UPDATE_VERSIONS)
    return [int(x) for x in v] if isinstance(v, list) else []
