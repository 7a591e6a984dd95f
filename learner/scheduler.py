"""The learner's scheduling round: when an update runs, and which data it may read.

``Scheduler.tick`` runs one round: publish a version held during an A/B experiment once the experiment has
decided, else wait for ``min_new_trajectories`` new settled, rewarded trajectories of the learner's traffic
(quarantined ones not counted: ``learner/quarantine.py``), an update request file, or an update the previous
learner process did not finish (retried at the first round), then run an update (``LearnerService.update``),
publishing only when no experiment is running; an unrequested update whose batch holds fewer than
``min_new_trajectories`` trainable trajectories (the others stale, say) trains nothing and keeps its cursor, and the
next one waits until as many new settled trajectories as it was short have come (not a re-read every round).
``_sleep`` waits between rounds, wakes on a request file and notices a dead parent server; ``_staleness_floor`` is
the oldest version whose data is still fresh.

Not here: the update itself (``learner/service.py``), training (``learner/rollout_steps.py``), publishing,
gates and experiments (``learner/release.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import structlog

from learner.samples import traffic_match
from learner.service_state import LINEAGE_START, REQUEST_FILE, ServiceState, _update_versions

log = structlog.get_logger(__name__)


class Scheduler(ServiceState):
    """When the learner updates (mixed into ``LearnerService``)."""

    def tick(self) -> bool:
        """One scheduling round; returns whether an update ran."""
        requested = (self.dir / REQUEST_FILE).exists()
        if requested:
            (self.dir / REQUEST_FILE).unlink(missing_ok=True)
        requested, self._retry = requested or self._retry, False  # a crashed predecessor's update is retried at once
        running = self.status.experiment is not None and self._experiment_running(self.status.experiment)
        if not running and self._held:
            self._publish_held()
            return True
        self.status.new_trajectories = self._count_new()
        own = self.cfg.settings.rollouts == "patr" or self.cfg.settings.rods.enabled  # the learner makes its own rollouts: no waiting
        if not requested and not own and self.status.new_trajectories < self.cfg.min_new_trajectories:
            wait = f"{self.status.new_trajectories}/{self.cfg.min_new_trajectories} new rewarded trajectories"
            if running:
                self._set("ab", f"experiment {self.status.experiment} running; {wait} for the next update")
            else:
                self._set("waiting", wait)
            return False
        if not requested and self._short is not None and not self._restart:
            # the last update found too few trainable trajectories (the rest stale or unsettled): only new settled ones can
            # add any, so re-reading the whole window every poll would only take CPU from the server it shares
            seen, need = self._short
            if self.status.new_trajectories < seen:  # the window moved (an update, a restart): count afresh
                self._short = None
            elif self.status.new_trajectories < seen + need:
                return False
        record = self.update(force=requested, publish=not running)
        return bool(record["metrics"])

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop and time.monotonic() < end and not (self.dir / REQUEST_FILE).exists():
            if self._parent is not None and os.getppid() != self._parent:
                log.info("the server that started this learner is gone; stopping", parent=self._parent)
                self.stop()
                break
            time.sleep(min(0.5, seconds))

    def _count_new(self) -> int:
        """New rewarded trajectories of this learner's traffic that have settled (the sample builder would take them now).

        The traffic's kind and agent are checked here; its model names and tags (on the turns) when the update reads them."""
        settled = time.time() - self.cfg.settings.samples.settle_s
        rows = self.store.list_trajectories(limit=100_000, since=self._seen_since, rewarded=True)
        kind = self.traffic.model_copy(update={"models": None, "tags": None})
        quarantined = self.ledger.quarantined()
        return sum(
            1
            for r in rows
            if not r["meta"].get("eval")
            and not r["meta"].get("rerollout")
            and traffic_match(r["meta"], kind)
            and (r["last_turn_at"] or 0) < settled
            and r["trajectory_id"] not in quarantined
        )

    def _staleness_floor(self, trainer: Any) -> int:
        """The oldest fresh version: the one the trainer reached ``max_staleness`` updates ago.

        Updates are counted whether their version was published or held during an A/B experiment (the policy
        moved either way), and an RTPO sweep's intermediate versions count as one update. The final versions of
        the last updates ride in the checkpoint (``trainer.cursor["update_versions"]``); a checkpoint without
        them (older learners) falls back to one version per update. A restart from the champion
        (``Release._restart_from_champion``) makes the champion's line the trainer's: the rejected versions leave the
        list, so the traffic the champion serves is fresh again (otherwise, with the trainer ``max_staleness``
        updates past the champion, every new trajectory would stay stale and the learner would never train again)."""
        k = self.cfg.settings.samples.max_staleness
        versions = _update_versions(trainer)
        if len(versions) > k:
            return versions[-1 - k]
        if versions or LINEAGE_START in trainer.cursor:  # fewer than k updates on this line: from its oldest known version on
            return int(trainer.cursor.get(LINEAGE_START, 0))
        return max(0, trainer.version - k)
