"""A/B experiments between adapter versions of one family: routing, status, and automatic decisions.

An experiment holds arms (``family@N`` with weights), a sticky key (``session`` or ``user``), the reward
source it judges by (``metric``; None = every *trusted* source, i.e. the runtime's own evaluators
``verifier:*`` and ``judge:*``, unless ``sources: "any"``: a client's feedback can then sway the
decision), ``min_samples``, ``alpha`` and whether to
``auto_promote`` / ``auto_rollback``. The champion is the family alias's target when the experiment
starts (it must be an arm). While it runs, requests naming the family alias are assigned an arm by
``routing.assign_arm`` over the sticky key (a pure hash: a session never flips arms).

``evaluate`` reads each arm's turn rewards since the start from the store, compares every challenger
with the champion by the always-valid mixture-SPRT p-value (``experiment_stats.decide``, safe to check
continuously; a fixed-horizon Welch t-test is reported beside it for reference), and applies the
decision: ``promote`` flips the alias to the winner and ends the experiment; ``rollback`` stops routing
to that arm, and once every challenger is rolled back the experiment ends (``rolled_back``); with
``max_samples``, an experiment still undecided when every live arm has that many rewards ends
``inconclusive`` (the champion stays), so an A/B between near-equal versions cannot run forever.
Each change of a challenger's p-value is kept in ``p_history`` (time, p, both arms' n; at most
``P_HISTORY_MAX`` points, thinned evenly), so the p-value can be drawn over time.
Config, state and every decision are saved in the store (``runtime/experiments_store.py``), so experiments
survive restarts; on a store shared by several runtimes each of them re-reads them every sync
(``runtime/registry_sync.py``), so they route a family alike, and a decision taken on one (the later write
wins) is followed by all.

Not here: HTTP (``store_routes``/``app``), loading adapters (``adapters.AdapterRegistry``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.experiment_stats import decide, summarize, welch_t_test
from runtime.experiments_store import ExperimentDatabase, ExperimentStore
from runtime.routing import Arm, assign_arm

log = logging.getLogger(__name__)


class ArmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    adapter: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}@[1-9][0-9]*$")
    weight: float = Field(1.0, gt=0)


class ExperimentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    family: str
    arms: list[ArmConfig] = Field(min_length=2)
    sticky: Literal["session", "user"] = "session"
    metric: str | None = None  # one reward source (exact); None = the sources below
    sources: Literal["trusted", "any"] = "trusted"  # with metric None: trusted = verifier:* and judge:* only
    min_samples: int = Field(100, ge=2)
    max_samples: int | None = Field(None, ge=2)  # undecided with this many per arm: ends "inconclusive", the champion stays
    alpha: float = Field(0.05, gt=0, lt=0.5)
    test: Literal["msprt"] = "msprt"
    auto_promote: bool = False
    auto_rollback: bool = False

    @model_validator(mode="after")
    def _arms_of_family(self) -> ExperimentConfig:
        names = [a.adapter for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError("arms must be distinct adapter versions")
        for n in names:
            if n.split("@")[0] != self.family:
                raise ValueError(f"arm {n} is not a version of family {self.family!r}")
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError(f"max_samples ({self.max_samples}) must be at least min_samples ({self.min_samples})")
        return self


class _Store(ExperimentDatabase, Protocol):
    """The interaction store: the database that keeps the experiments (``ExperimentStore``) and answers the arms' data."""

    def arm_observations(self, adapter: str, since: float, source: str | None = None, *, trusted_only: bool = True) -> dict[str, list[float]]: ...


class _Registry(Protocol):
    def aliases(self) -> dict[str, str]: ...
    def set_alias(self, family: str, target_name: str) -> None: ...


class ExperimentError(ValueError):
    """An experiment request that cannot be honoured (unknown arm, a family already under test, ...)."""


class Experiments:
    def __init__(self, store: _Store, registry: _Registry) -> None:
        self.store = store
        self.saved = ExperimentStore(store)
        self.registry = registry
        self.configs: dict[str, ExperimentConfig] = {}
        self.states: dict[str, dict[str, Any]] = {}
        self.apply_stored(self.saved.load())

    def apply_stored(self, rows: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> None:
        """Take the experiments as stored (at start-up; on a shared store, every sync: another runtime may have
        created, decided or stopped one). An experiment this process has that the store lacks is kept."""
        for name, config, state in rows:
            self.configs[name] = ExperimentConfig.model_validate(config)
            self.states[name] = state

    def live_arms(self) -> set[str]:
        """The arms of running experiments that still take traffic (every runtime must have them loaded)."""
        out: set[str] = set()
        for name, cfg in self.configs.items():
            state = self.states[name]
            if state["status"] == "running":
                out |= {a.adapter for a in cfg.arms if a.adapter not in state["stopped_arms"]}
        return out

    def running_for(self, family: str) -> ExperimentConfig | None:
        for name, cfg in self.configs.items():
            if cfg.family == family and self.states[name]["status"] == "running":
                return cfg
        return None

    def create(self, cfg: ExperimentConfig, registered: set[str]) -> dict[str, Any]:
        if cfg.name in self.configs:
            raise ExperimentError(f"experiment {cfg.name!r} already exists")
        if self.running_for(cfg.family) is not None:
            raise ExperimentError(f"family {cfg.family!r} already has a running experiment")
        missing = [a.adapter for a in cfg.arms if a.adapter not in registered]
        if missing:
            raise ExperimentError(f"arms not loaded: {', '.join(missing)}")
        champion = self.registry.aliases().get(cfg.family)
        if champion not in {a.adapter for a in cfg.arms}:
            raise ExperimentError(f"the family alias {cfg.family!r} must point at one of the arms (it points at {champion})")
        state = {"status": "running", "champion": champion, "started_at": time.time(), "stopped_arms": [], "p_values": {}, "decisions": []}
        self.configs[cfg.name], self.states[cfg.name] = cfg, state
        self.saved.save(cfg.name, cfg.model_dump(), state)
        return self.status(cfg.name)

    def route(self, family: str, session_key: str, user_key: str | None) -> str | None:
        """The arm for a request to the family alias, or None when no experiment runs for it."""
        cfg = self.running_for(family)
        if cfg is None:
            return None
        state = self.states[cfg.name]
        key = (user_key or session_key) if cfg.sticky == "user" else session_key
        # assign over all arms, so stopping one never moves keys between the arms that stay on;
        # keys of a stopped (rolled-back) arm go to the champion
        arm = assign_arm(key, [Arm(a.adapter, a.weight) for a in cfg.arms], salt=cfg.name)
        return state["champion"] if arm in state["stopped_arms"] else arm

    def stop(self, name: str) -> dict[str, Any]:
        state = self._state(name)
        if state["status"] == "running":
            state["status"] = "stopped"
            state["decisions"].append({"time": time.time(), "action": "stop", "arm": None, "reason": "stopped by an admin"})
            self.saved.save(name, self.configs[name].model_dump(), state)
        return self.status(name)

    def promote(self, name: str, arm: str, reason: str = "promoted by an admin") -> dict[str, Any]:
        cfg, state = self.configs[name], self._state(name)
        if arm not in {a.adapter for a in cfg.arms}:
            raise ExperimentError(f"{arm} is not an arm of {name}")
        self.registry.set_alias(cfg.family, arm)
        state.update(status="promoted", winner=arm)
        state["decisions"].append({"time": time.time(), "action": "promote", "arm": arm, "reason": reason})
        self.saved.save(name, cfg.model_dump(), state)
        return self.status(name)

    def _observations(self, cfg: ExperimentConfig, adapter: str, since: float) -> dict[str, list[float]]:
        return self.store.arm_observations(adapter, since, cfg.metric, trusted_only=cfg.sources == "trusted")

    def evaluate(self, name: str) -> dict[str, Any]:
        """Recompute statistics and, for a running experiment with auto actions, apply the decision."""
        cfg, state = self.configs[name], self._state(name)
        if state["status"] != "running":
            return self.status(name)
        obs = {a.adapter: self._observations(cfg, a.adapter, state["started_at"]) for a in cfg.arms}
        champion = state["champion"]
        changed = False
        for arm in cfg.arms:
            if arm.adapter == champion or arm.adapter in state["stopped_arms"]:
                continue
            d = decide(
                obs[champion]["rewards"],
                obs[arm.adapter]["rewards"],
                alpha=cfg.alpha,
                min_samples=cfg.min_samples,
                prev_p=state["p_values"].get(arm.adapter, 1.0),
            )
            if d.p_value != state["p_values"].get(arm.adapter):
                state["p_values"][arm.adapter] = d.p_value
                _append_p(state, arm.adapter, d.p_value, len(obs[champion]["rewards"]), len(obs[arm.adapter]["rewards"]))
                changed = True
            if d.action == "promote" and cfg.auto_promote:
                return self.promote(name, arm.adapter, reason=d.reason)
            if d.action == "rollback" and cfg.auto_rollback:
                state["stopped_arms"].append(arm.adapter)
                state["decisions"].append({"time": time.time(), "action": "rollback", "arm": arm.adapter, "reason": d.reason})
                changed = True
        changed = self._end_if_over(cfg, state, obs) or changed
        if changed:
            self.saved.save(name, cfg.model_dump(), state)
        return self.status(name, obs)

    @staticmethod
    def _end_if_over(cfg: ExperimentConfig, state: dict[str, Any], obs: dict[str, dict[str, list[float]]]) -> bool:
        """End an experiment with nothing left to decide: every challenger rolled back, or ``max_samples`` reached undecided."""
        champion = state["champion"]
        live = [a.adapter for a in cfg.arms if a.adapter != champion and a.adapter not in state["stopped_arms"]]
        if not live:
            status, reason = "rolled_back", "every challenger was rolled back: the champion stays"
        elif cfg.max_samples is not None and all(len(obs[a]["rewards"]) >= cfg.max_samples for a in [champion, *live]):
            status, reason = "inconclusive", f"no decision after {cfg.max_samples} rewards per arm: the champion stays"
        else:
            return False
        state["status"] = status
        state["decisions"].append({"time": time.time(), "action": "end", "arm": None, "reason": reason})
        return True

    def status(self, name: str, obs: dict[str, dict[str, list[float]]] | None = None) -> dict[str, Any]:
        cfg, state = self.configs[name], self._state(name)
        if obs is None:
            obs = {a.adapter: self._observations(cfg, a.adapter, state["started_at"]) for a in cfg.arms}
        champion = state["champion"]
        arms = []
        for a in cfg.arms:
            o = obs[a.adapter]
            s = summarize(o["rewards"]) if o["rewards"] else None
            row: dict[str, Any] = {
                "adapter": a.adapter,
                "weight": a.weight,
                "champion": a.adapter == champion,
                "stopped": a.adapter in state["stopped_arms"],
                "n": len(o["rewards"]),
                "mean_reward": _num(s.mean) if s else None,
                "ci95": [_num(s.ci_low), _num(s.ci_high)] if s else None,
                "requests": len(o["latency_s"]),
                "mean_latency_s": _num(sum(o["latency_s"]) / len(o["latency_s"])) if o["latency_s"] else None,
                "tokens_per_s": _num(sum(o["tokens_per_s"]) / len(o["tokens_per_s"])) if o["tokens_per_s"] else None,
            }
            if a.adapter != champion:
                row["msprt_p_value"] = state["p_values"].get(a.adapter, 1.0)
                if len(o["rewards"]) >= 2 and len(obs[champion]["rewards"]) >= 2:
                    t, p = welch_t_test(obs[champion]["rewards"], o["rewards"])
                    row["welch_t"], row["welch_p_fixed_horizon"] = _num(t), _num(p)
            arms.append(row)
        return {"name": name, "config": cfg.model_dump(), **{k: v for k, v in state.items() if k != "p_values"}, "arms": arms}

    def _state(self, name: str) -> dict[str, Any]:
        if name not in self.states:
            raise KeyError(name)
        return self.states[name]


P_HISTORY_MAX = 512  # points kept per arm; past it every other older point is dropped (the newest always stays)


def _append_p(state: dict[str, Any], arm: str, p: float, n_champion: int, n: int) -> None:
    """Record the arm's always-valid p-value as it changes (``p_history``), for the console's p-value-over-time chart."""
    hist = state.setdefault("p_history", {}).setdefault(arm, [])
    hist.append({"t": time.time(), "p": p, "n_champion": n_champion, "n": n})
    if len(hist) > P_HISTORY_MAX:
        hist[:] = [*hist[:-1:2], hist[-1]]


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)
