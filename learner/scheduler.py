"""The learner's scheduling round: when an update runs, and which data it may read.

``Scheduler.next_round`` decides one round (``LearnerService.tick`` carries it out): publish a version held during
an A/B experiment once the experiment has decided, else wait for ``min_new_trajectories`` new settled, rewarded
trajectories of the learner's traffic (quarantined ones not counted: ``learner/quarantine.py``), an update request
file, or an update the previous learner process did not finish (retried at the first round), then run an update
(``LearnerService.update``), publishing only when no experiment is running; an unrequested update whose batch holds
fewer than ``min_new_trajectories`` trainable trajectories (the others stale, say) trains nothing and keeps its
cursor, and the next one waits until as many new settled trajectories as it was short have come (not a re-read
every round). ``staleness_floor`` is the oldest version whose data is still fresh.

Not here: the update itself and the wait between rounds (``learner/service.py``), training
(``learner/rollout_steps.py``), publishing, gates and experiments (``learner/release.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from learner.release import Release
from learner.samples import traffic_match
from learner.service_state import LINEAGE_START, REQUEST_FILE, ServiceState, update_versions
from learner.update import Trainer


@dataclass(frozen=True)
class Round:
    """What one scheduling round does: publish the held version, wait, or update (``force``: requested or retried, it
    trains whatever the window holds; ``publish``: no experiment is running)."""

    action: Literal["publish_held", "wait", "update"]
    force: bool = False
    publish: bool = True


class Scheduler:
    """When the learner updates: the learner service's scheduling job (module docstring)."""

    def __init__(self, state: ServiceState, release: Release) -> None:
        self.state = state
        self.release = release  # follows the running experiment (its decision may release a held version)
        self.retry = False  # the previous process did not finish an update: run one at the first round
        # an update found too few trainable: (new trajectories counted then, how many more it needs)
        self.short: tuple[int, int] | None = None
        self.seen_since = time.time()  # new trajectories are counted from here: the data cursor (each update moves it)

    def next_round(self) -> Round:
        """What this round does (the request file is consumed, the status written while waiting)."""
        state = self.state
        requested = (state.dir / REQUEST_FILE).exists()
        if requested:
            (state.dir / REQUEST_FILE).unlink(missing_ok=True)
        requested, self.retry = requested or self.retry, False  # a crashed predecessor's update is retried at once
        running = state.status.experiment is not None and self.release.experiment_running(state.status.experiment)
        if not running and state.held:
            return Round("publish_held")
        state.status.new_trajectories = self.count_new()
        own = state.cfg.settings.rollouts == "patr" or state.cfg.settings.rods.enabled  # the learner makes its own rollouts: no waiting
        if not requested and not own and state.status.new_trajectories < state.cfg.min_new_trajectories:
            wait = f"{state.status.new_trajectories}/{state.cfg.min_new_trajectories} new rewarded trajectories"
            if running:
                state.set_status("ab", f"experiment {state.status.experiment} running; {wait} for the next update")
            else:
                state.set_status("waiting", wait)
            return Round("wait")
        if not requested and self.short is not None and not state.restart:
            # the last update found too few trainable trajectories (the rest stale or unsettled): only new settled ones can
            # add any, so re-reading the whole window every poll would only take CPU from the server it shares
            seen, need = self.short
            if state.status.new_trajectories < seen:  # the window moved (an update, a restart): count afresh
                self.short = None
            elif state.status.new_trajectories < seen + need:
                return Round("wait")
        return Round("update", force=requested, publish=not running)

    def count_new(self) -> int:
        """New rewarded trajectories of this learner's traffic that have settled (the sample builder would take them now).

        The traffic's kind and agent are checked here; its model names and tags (on the turns) when the update reads them."""
        settled = time.time() - self.state.cfg.settings.samples.settle_s
        rows = self.state.store.list_trajectories(limit=100_000, since=self.seen_since, rewarded=True)
        kind = self.state.traffic.model_copy(update={"models": None, "tags": None})
        quarantined = self.state.ledger.quarantined()
        return sum(
            1
            for r in rows
            if not r["meta"].get("eval")
            and not r["meta"].get("rerollout")
            and traffic_match(r["meta"], kind)
            and (r["last_turn_at"] or 0) < settled
            and r["trajectory_id"] not in quarantined
        )

    def staleness_floor(self, trainer: Trainer) -> int:
        """The oldest fresh version: the one the trainer reached ``max_staleness`` updates ago.

        Updates are counted whether their version was published or held during an A/B experiment (the policy
        moved either way), and an RTPO sweep's intermediate versions count as one update. The final versions of
        the last updates ride in the checkpoint (``trainer.cursor["update_versions"]``); a checkpoint without
        them (older learners) falls back to one version per update. A restart from the champion
        (``Release.restart_from_champion``) makes the champion's line the trainer's: the rejected versions leave the
        list, so the traffic the champion serves is fresh again (otherwise, with the trainer ``max_staleness``
        updates past the champion, every new trajectory would stay stale and the learner would never train again)."""
        k = self.state.cfg.settings.samples.max_staleness
        versions = update_versions(trainer)
        if len(versions) > k:
            return versions[-1 - k]
        if versions or LINEAGE_START in trainer.cursor:  # fewer than k updates on this line: from its oldest known version on
            return int(trainer.cursor.get(LINEAGE_START, 0))
        return max(0, trainer.version - k)
