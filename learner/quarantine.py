"""The learner's record of update attempts: an in-flight marker per batch, and the quarantine of batches that fail twice.

    ledger = BatchLedger(learner_dir)                # <data-dir>/learner/<family>/
    outcome = ledger.recover()                       # at start: a marker left by a process that died mid-update
    batch = collect_samples(..., exclude=ledger.quarantined())   # learner.samples: counted as ``quarantined`` turns
    ledger.begin(trajectory_ids)                     # before training on a batch
    ... train, checkpoint ...
    ledger.done()                                    # after its checkpoint: the batch is trained
    # or, when the update raised:  ledger.failed(exc)  |  ledger.interrupted()  (a stop, or the runtime away)

Why: a record that makes an update raise (token ids outside the model's vocabulary, a shape no code path
expected) would otherwise stop learning for good: the learner process exits, and the restarted one reads the
same data window (its cursor lives in the last checkpoint) and fails again. So:

- **The marker** ``inflight.json`` holds the batch being trained (its trajectory ids), the *suspects* (the ids
  that were in every failed attempt so far; the batch of a retry may hold more, newer trajectories), the
  failures counted against them, and ``active`` (an attempt is running now). It is written before training
  and removed once the update's checkpoint is written.
- **What counts as a failure**: an exception from the update (``failed``; when the exception names the
  trajectories it refused, as the trainer's :class:`learner.trainer.SampleError` and the estimators'
  :class:`learner.advantages.AdvantageInputError` do, the suspects narrow to those), and a process that died
  mid-update without cleaning up (SIGKILL, the OOM killer, a segfault): its marker is still ``active`` when the
  next process starts (``recover``). A normal stop does not count:
  ``SystemExit``/``KeyboardInterrupt`` and the runtime being away (``AdminError``, HTTP errors) end the attempt
  with ``interrupted``, and a SIGTERM marks the marker ``terminating`` first, so the SIGKILL that may follow a
  graceful-stop timeout is not taken for a crash either.
- **Quarantine**: at the ``after``-th failure (2) the suspects go to ``quarantine.json`` (ids, when, why, the
  errors) and every later update skips them (``collect_samples(exclude=...)``, counted as ``quarantined`` turns). The
  rest of the batch is retried at once; the data cursor moves past the quarantined trajectories with the next
  checkpoint, like past any skipped record. Nothing is deleted from the store. Deleting ``quarantine.json``
  lifts the quarantine for data the cursor has not passed yet (none, for a batch quarantined by a crash).

Files are written whole (temp file + ``os.replace``). One learner process per family and data folder writes
them (the same rule as for checkpoints).

Not here: restarting the process (``learner/supervisor.py``, used by ``serve.py``), what the status shows
(``learner/service.py``).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from learner.samples import stored_trajectory_id

__all__ = [
    "DIED",
    "INFLIGHT_FILE",
    "QUARANTINE_AFTER",
    "QUARANTINE_FILE",
    "BatchLedger",
    "Outcome",
    "error_record",
]

log = structlog.get_logger(__name__)

INFLIGHT_FILE = "inflight.json"
QUARANTINE_FILE = "quarantine.json"
QUARANTINE_AFTER = 2  # failures of the same suspects before they are quarantined
TRACEBACK_LINES = 12  # the last lines of a traceback kept in an error record
DIED = "ProcessDied"  # the error type recorded for a process that died mid-update without cleaning up


def error_record(exc: BaseException | None = None, *, kind: str = "", message: str = "") -> dict[str, Any]:
    """``{"type", "message", "traceback", "at"}`` for the status and the files: the exception's type, its message
    (at most 2000 characters) and the last lines of its traceback; or ``kind``/``message`` for what left no exception."""
    if exc is None:
        return {"type": kind, "message": message, "traceback": [], "at": time.time()}
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": lines[-TRACEBACK_LINES:], "at": time.time()}


@dataclass
class Outcome:
    """A pending batch: its failures so far, the last error, whether this call counted a new failure, and what that quarantined."""

    failures: int
    error: dict[str, Any]
    counted: bool = False
    quarantined: list[str] = field(default_factory=list)


class BatchLedger:
    """The in-flight marker and the quarantine of one learner's folder (module docstring)."""

    def __init__(self, folder: Path, *, after: int = QUARANTINE_AFTER) -> None:
        self.folder = Path(folder)
        self.after = after
        self._active = False  # this process began an attempt that has not ended
        self._terminating = False  # a SIGTERM arrived: an attempt cut short from now on is a stop
        self._ids: set[str] | None = None  # quarantined ids, read once and kept current by this process

    # ---- the quarantine ----------------------------------------------------------------------------
    def batches(self) -> list[dict[str, Any]]:
        """The quarantined batches, oldest first: ``{"trajectory_ids", "at", "reason", "failures", "errors"}``."""
        data = _read(self.folder / QUARANTINE_FILE)
        batches = data.get("batches") if isinstance(data, dict) else None
        return [b for b in batches if isinstance(b, dict)] if isinstance(batches, list) else []

    def quarantined(self) -> set[str]:
        """Every quarantined trajectory id."""
        if self._ids is None:
            self._ids = {str(t) for b in self.batches() for t in b.get("trajectory_ids") or []}
        return self._ids

    def summary(self, last: int = 10) -> dict[str, Any]:
        """For the status: ``{"trajectories", "batches", "last_at", "recent": the newest ``last`` batches with their ids, when, why}``."""
        batches = self.batches()
        recent = [{k: b.get(k) for k in ("trajectory_ids", "at", "reason", "failures")} for b in batches[-last:]]
        return {
            "trajectories": len({t for b in batches for t in b.get("trajectory_ids") or []}),
            "batches": len(batches),
            "last_at": batches[-1].get("at") if batches else None,
            "recent": recent[::-1],  # newest first
        }

    def _quarantine(self, ids: Iterable[str], errors: list[dict[str, Any]], failures: int) -> list[str]:
        ids = sorted(set(ids))
        last = errors[-1] if errors else {}
        batch = {
            "trajectory_ids": ids,
            "at": time.time(),
            "reason": f"failed {failures} updates; last: {last.get('type', '?')}: {last.get('message', '')}",
            "failures": failures,
            "errors": [{k: e.get(k) for k in ("type", "message", "at")} for e in errors],
        }
        _write(self.folder / QUARANTINE_FILE, {"batches": [*self.batches(), batch]})
        self._ids = None
        log.warning("batch quarantined: later updates skip its trajectories", trajectories=len(ids), trajectory_ids=ids[:20], reason=batch["reason"])
        return ids

    # ---- the in-flight marker ----------------------------------------------------------------------
    def marker(self) -> dict[str, Any] | None:
        data = _read(self.folder / INFLIGHT_FILE)
        return data if isinstance(data, dict) else None

    def pending(self) -> dict[str, Any] | None:
        """For the status: the batch that failed and is being retried (``{"trajectories", "suspects", "failures", "since"}``), else None."""
        m = self.marker()
        if m is None or not int(m.get("failures") or 0):
            return None
        return {
            "trajectories": len(m.get("trajectory_ids") or []),
            "suspects": len(m.get("suspects") or []),
            "failures": int(m["failures"]),
            "since": m.get("first_failed_at"),
        }

    def begin(self, trajectory_ids: Iterable[str]) -> None:
        """An attempt at a batch starts. A marker of failed attempts carries its count over while the new batch still holds
        some of its suspects (a retry reads the same window, plus what arrived since); otherwise the count starts at 0."""
        ids = sorted(set(trajectory_ids))
        if not ids:  # nothing stored to blame (own rollouts only): a failure is the process's, not a batch's
            return
        prev = self.marker() or {}
        suspects = set(prev.get("suspects") or []) & set(ids) if int(prev.get("failures") or 0) else set()
        failures = int(prev.get("failures") or 0) if suspects else 0
        marker = {
            "trajectory_ids": ids,
            "suspects": sorted(suspects) if suspects else ids,
            "failures": failures,
            "errors": list(prev.get("errors") or []) if suspects else [],
            "first_failed_at": prev.get("first_failed_at") if suspects else None,
            "active": True,
            "terminating": self._terminating,
            "pid": os.getpid(),
            "started_at": time.time(),
        }
        _write(self.folder / INFLIGHT_FILE, marker)
        self._active = True

    def done(self) -> None:
        """The batch trained and its checkpoint is written: no attempt in flight."""
        if self._active or (self.folder / INFLIGHT_FILE).exists():
            (self.folder / INFLIGHT_FILE).unlink(missing_ok=True)
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def interrupted(self) -> None:
        """The attempt ended without its batch being at fault (a stop, the runtime away): not a failure. The marker stays only
        while it carries earlier failures (the next attempt keeps counting them)."""
        if not self._active:
            return
        self._active = False
        m = self.marker()
        if m is None:
            return
        if int(m.get("failures") or 0):
            _write(self.folder / INFLIGHT_FILE, {**m, "active": False, "terminating": False})
        else:
            (self.folder / INFLIGHT_FILE).unlink(missing_ok=True)

    def terminating(self) -> None:
        """A SIGTERM arrived: if the process is killed before its attempt ends, that is a stop, not a crash (module docstring).
        Called from the signal handler: one small file write, through its own temp file (the handler may run in the middle of
        another write of the marker)."""
        self._terminating = True
        if not self._active:
            return
        m = self.marker()
        if m is not None and m.get("active"):
            _write(self.folder / INFLIGHT_FILE, {**m, "terminating": True}, tmp=".signal.tmp")

    def failed(self, exc: BaseException) -> Outcome | None:
        """The attempt raised ``exc``: count a failure against the suspects (narrowed to the trajectories ``exc`` names, when it
        names some of them), and quarantine them at the ``after``-th. None when no attempt at a stored batch was in flight."""
        if not self._active:
            return None
        self._active = False
        named = getattr(exc, "trajectory_ids", None)
        if not isinstance(named, list | tuple | set | frozenset) or not named:
            named = None
        else:  # a sample's id may name a part of a stored trajectory (group completion): the stored one is the suspect
            named = [stored_trajectory_id(str(t)) for t in named]
        return self._count(error_record(exc), named)

    def recover(self) -> Outcome | None:
        """At start: a marker this folder's previous learner left ``active`` means that process died during the update
        (killed, out of memory, crashed in native code) without recording it: count it as a failure, unless a SIGTERM
        preceded it (``terminating``: a stop). Returns that failure's outcome; an ``Outcome`` with the failures so far when
        a failed batch waits for its retry, or with 0 failures when the rest of a quarantined batch waits for it (the
        marker then goes: nothing is counted any more); None when no batch is pending."""
        m = self.marker()
        if m is None:
            return None
        if m.get("active") and not m.get("terminating"):
            message = f"the learner process (pid {m.get('pid')}) died during an update without cleaning up: killed (SIGKILL, OOM) or crashed"
            return self._count(error_record(kind=DIED, message=message), None, m)
        failures = int(m.get("failures") or 0)
        if not failures:  # stopped by a SIGTERM mid-attempt, or what is left of a quarantined batch: retried, nothing counted
            (self.folder / INFLIGHT_FILE).unlink(missing_ok=True)
            return Outcome(failures=0, error={})
        if m.get("active"):
            _write(self.folder / INFLIGHT_FILE, {**m, "active": False, "terminating": False})
        errors = list(m.get("errors") or [])
        return Outcome(failures=failures, error=errors[-1] if errors else {})

    def _count(self, error: dict[str, Any], named: Iterable[str] | None, marker: dict[str, Any] | None = None) -> Outcome:
        m = marker if marker is not None else self.marker()
        if m is None:  # removed under us: nothing to count against
            return Outcome(failures=0, error=error)
        suspects = set(m.get("suspects") or m.get("trajectory_ids") or [])
        if named is not None and suspects & {str(t) for t in named}:
            suspects &= {str(t) for t in named}
        failures = int(m.get("failures") or 0) + 1
        errors = [*list(m.get("errors") or []), {k: error.get(k) for k in ("type", "message", "at")}]
        if failures >= self.after:
            quarantined = self._quarantine(suspects, errors, failures)
            # the rest of the batch (if any) is retried next: a marker without suspects says "retry now" and counts nothing
            _write(self.folder / INFLIGHT_FILE, {"trajectory_ids": m.get("trajectory_ids") or [], "suspects": [], "failures": 0, "active": False})
            return Outcome(failures=failures, error=error, counted=True, quarantined=quarantined)
        first = m.get("first_failed_at") or error["at"]
        marker = {**m, "suspects": sorted(suspects), "failures": failures, "errors": errors, "first_failed_at": first, "active": False}
        _write(self.folder / INFLIGHT_FILE, marker | {"terminating": False})
        return Outcome(failures=failures, error=error, counted=True)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:  # damaged: report, and go on as if absent (a crash must not block learning)
        log.warning("unreadable learner ledger file, ignored", path=str(path), error=str(exc))
        return None


def _write(path: Path, data: dict[str, Any], tmp: str = ".tmp") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + tmp)
    part.write_text(json.dumps(data))
    os.replace(part, path)
