"""A/B experiments between adapter versions of one family: routing, status, and automatic decisions.

An experiment holds arms (``family@N`` with weights), a sticky key (``session`` or ``user``), the reward
source it judges by (``metric``; None = every *trusted* source, i.e. the runtime's own evaluators
``verifier:*`` and ``judge:*``, unless ``sources: "any"``: a client's feedback can then sway the
decision; or ``reward_sources``, patterns in precedence order as a learner's ``[samples]`` has them: the
experiment judges by its best-ranked source present, ranked once across turn and trajectory rewards, the newest
reward per rated turn or trajectory, so it decides on the rewards its learner trains on), which owners' evidence
counts (``owners``; None = all) and how much one owner may weigh (``max_owner_share``: with K owners an owner
keeps its oldest observations up to ``max(share, 1/K)`` of an arm's, ``learner.records.owner_quota``),
``min_samples``, ``alpha``, ``max_duration_s`` and whether to ``auto_promote`` / ``auto_rollback``. Work done
through the admin API (the learner's own runs, re-rollouts, siblings, gates, evaluations) is never evidence.
The champion is the family alias's target when the experiment starts (it must be an arm). While it runs,
requests naming the family alias are assigned an arm by ``routing.assign_arm`` over the sticky key (a pure hash: a session never flips arms).

``evaluate`` reads each arm's turn rewards since the start from the store, compares every challenger
with the champion by the always-valid mixture-SPRT p-value (``experiment_stats.decide``, safe to check
continuously; a fixed-horizon Welch t-test is reported beside it for reference), and applies the
decision: ``promote`` flips the alias to the winner and ends the experiment; ``rollback`` stops routing
to that arm, and once every challenger is rolled back the experiment ends (``rolled_back``); with
``max_samples``, an experiment still undecided when every live arm has that many rewards ends
``inconclusive`` (the champion stays), so an A/B between near-equal versions cannot run forever; with
``max_duration_s`` it also ends ``inconclusive`` once that much time has passed undecided, evidence or none
(the status says ``evidence`` in words while an arm has none). With ``non_inferiority_margin`` (pooled sds) an
experiment that ends undecided with ``min_samples`` per arm promotes instead the best challenger shown non-inferior
(``experiment_stats.non_inferiority``, looked at once, at the end): a continual learner's next version ships unless
the evidence allows it to be worse by the margin; with ``non_inferiority_chain`` (the earlier promotions' effects, which a
learner carries from one experiment to the next) the margin bounds the drift of the whole chain from its anchor, so
small losses cannot add up. Every promotion records its ``effect`` (difference and variance in pooled sds). When the evidence
holds several reward sources, every decision compares rewards standardized within their source
(``_score_within_source``), never raw means across scales.
A decided experiment's figures are those at its end (``ended_at``): later rewards on its arms' turns do not move them.
Each change of a challenger's p-value is kept in ``p_history`` (time, p, both arms' n; at most
``P_HISTORY_MAX`` points, thinned evenly), so the p-value can be drawn over time.
Config, state and every decision are saved in the store (``learner/records/experiments_store.py``), so experiments
survive restarts; on a store shared by several runtimes each of them re-reads them every sync
(``runtime/adapters/sync.py``), so they route a family alike, and a decision taken on one (the later write
wins) is followed by all.

:func:`evaluate_forever` applies the automatic decisions every few seconds (the app runs it in the background).

Not here: HTTP (``runtime/admin/adapters.py``), loading adapters (``runtime/adapters/registry.py``), the routing
decision (``runtime/adapters/routing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.records import owner_quota, source_rank
from learner.records.experiments_store import ExperimentDatabase, ExperimentStore
from runtime.adapters.experiment_stats import decide, non_inferiority, standardized_effect, summarize, welch_t_test
from runtime.adapters.routing import Arm, assign_arm

log = logging.getLogger(__name__)


class ArmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    adapter: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}@[1-9][0-9]*$")
    weight: float = Field(1.0, gt=0)


class NonInferiorityChain(BaseModel):
    """The promotions before this experiment, in pooled sds (``experiment_stats.non_inferiority``'s prior): the sums of
    their ``effect`` (an ended experiment's state) since ``anchor``, the version the chain started from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    anchor: str | None = Field(None, max_length=200)
    diff_sd: float = Field(0.0, allow_inf_nan=False, ge=-100, le=100)
    var_sd: float = Field(0.0, allow_inf_nan=False, ge=0, le=100)
    steps: int = Field(0, ge=0)


class ExperimentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    family: str
    arms: list[ArmConfig] = Field(min_length=2)
    sticky: Literal["session", "user"] = "session"
    metric: str | None = None  # one reward source (exact); None = the sources below
    sources: Literal["trusted", "any"] = "trusted"  # with metric None: trusted = verifier:* and judge:* only
    reward_sources: list[str] | None = Field(None, min_length=1, max_length=32)  # patterns, best first (a learner's rule); excludes metric
    owners: list[str] | None = Field(None, max_length=10_000)  # only these owners' evidence counts; None = every owner
    max_owner_share: float = Field(1.0, gt=0, le=1)  # one owner's observations per arm at most max(share, 1/K) of them
    max_duration_s: float | None = Field(None, gt=0)  # undecided after this long: ends "inconclusive", the champion stays
    min_samples: int = Field(100, ge=2)
    max_samples: int | None = Field(None, ge=2)  # undecided with this many per arm: ends "inconclusive", the champion stays
    # in pooled sds: an experiment that ends undecided (max_samples or max_duration_s) with min_samples per arm promotes the
    # best challenger shown non-inferior by that margin (experiment_stats.non_inferiority) instead of keeping the champion
    non_inferiority_margin: float | None = Field(None, ge=0, le=2)
    # with a margin: the earlier promotions of the same line, so the margin bounds the drift from the chain's anchor
    non_inferiority_chain: NonInferiorityChain | None = None
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
        if self.reward_sources is not None:
            if self.metric is not None:
                raise ValueError("give metric (one exact source) or reward_sources (patterns in precedence order), not both")
            if any(not p.strip() or len(p) > 200 for p in self.reward_sources) or len(set(self.reward_sources)) != len(self.reward_sources):
                raise ValueError("reward_sources must be distinct, non-empty source patterns (e.g. 'verifier:*', 'feedback', '*')")
        return self

    def describe_sources(self) -> str:
        """The evidence this experiment counts, in words (for its status)."""
        if self.metric is not None:
            return f"rewards of source {self.metric!r}"
        if self.reward_sources is not None:
            return "rewards of the best-ranked source of " + ", ".join(self.reward_sources)
        return "rewards of any source" if self.sources == "any" else "the runtime's verifier:* and judge:* rewards"


class _Store(ExperimentDatabase, Protocol):
    """The interaction store: the database that keeps the experiments (``ExperimentStore``) and answers the arms' data."""

    def arm_observations(
        self, adapter: str, since: float, source: str | None = None, *, trusted_only: bool = True, until: float | None = None
    ) -> dict[str, list[Any]]: ...


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
            state["status"], state["ended_at"] = "stopped", time.time()
            state["decisions"].append({"time": time.time(), "action": "stop", "arm": None, "reason": "stopped by an admin"})
            self.saved.save(name, self.configs[name].model_dump(), state)
        return self.status(name)

    def promote(
        self, name: str, arm: str, reason: str = "promoted by an admin", obs: dict[str, dict[str, list[Any]]] | None = None
    ) -> dict[str, Any]:
        cfg, state = self.configs[name], self._state(name)
        if arm not in {a.adapter for a in cfg.arms}:
            raise ExperimentError(f"{arm} is not an arm of {name}")
        self.registry.set_alias(cfg.family, arm)
        _record_effect(state, obs if obs is not None else self._observations(cfg, state), arm)
        state.update(status="promoted", winner=arm, ended_at=time.time())
        state["decisions"].append({"time": time.time(), "action": "promote", "arm": arm, "reason": reason})
        self.saved.save(name, cfg.model_dump(), state)
        return self.status(name)

    def _observations(self, cfg: ExperimentConfig, state: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
        """Every arm's observations under the experiment's source and owner rules (module docstring), from its start to its
        end (``ended_at``: a decided experiment's figures no longer move)."""
        patterns = cfg.reward_sources
        trusted = cfg.sources == "trusted" and patterns is None
        since, until = float(state["started_at"]), state.get("ended_at")
        raw = {a.adapter: self.store.arm_observations(a.adapter, since, cfg.metric, trusted_only=trusted, until=until) for a in cfg.arms}
        rows = {arm: [e for e in o["evidence"] if cfg.owners is None or e[4] in cfg.owners] for arm, o in raw.items()}
        if patterns is not None:  # one source for the experiment: the best rank present on any arm, turn and trajectory rewards alike
            ranks = {arm: [source_rank(e[1], patterns) for e in es] for arm, es in rows.items()}
            present = [r for rs in ranks.values() for r in rs if r is not None]
            best = min(present, default=None)
            for arm, es in rows.items():
                newest: dict[tuple[str, str], int] = {}  # (target, target_id) -> index of its newest reward of that rank
                for i, (e, r) in enumerate(zip(es, ranks[arm], strict=True)):
                    if r is not None and r == best:
                        newest[(e[2], e[3])] = i
                keep = sorted(newest.values())
                rows[arm] = [es[i] for i in keep]
        out: dict[str, dict[str, list[Any]]] = {}
        for arm, es in rows.items():
            if cfg.max_owner_share < 1.0:
                counts: dict[str, int] = {}
                for e in es:
                    counts[e[4]] = counts.get(e[4], 0) + 1
                quota, taken = owner_quota(counts, cfg.max_owner_share), dict.fromkeys(counts, 0)
                kept = []
                for e in es:  # oldest first: an owner's first observations up to its quota
                    if taken[e[4]] < quota[e[4]]:
                        taken[e[4]] += 1
                        kept.append(e)
                es = kept
            out[arm] = {**raw[arm], "rewards": [e[0] for e in es], "sources": [e[1] for e in es], "owners": sorted({e[4] for e in es})}
        _score_within_source(out)
        return out

    def evaluate(self, name: str) -> dict[str, Any]:
        """Recompute statistics and, for a running experiment with auto actions, apply the decision."""
        cfg, state = self.configs[name], self._state(name)
        if state["status"] != "running":
            return self.status(name)
        obs = self._observations(cfg, state)
        champion = state["champion"]
        changed = False
        for arm in cfg.arms:
            if arm.adapter == champion or arm.adapter in state["stopped_arms"]:
                continue
            d = decide(
                obs[champion]["scores"],
                obs[arm.adapter]["scores"],
                alpha=cfg.alpha,
                min_samples=cfg.min_samples,
                prev_p=state["p_values"].get(arm.adapter, 1.0),
            )
            if d.p_value != state["p_values"].get(arm.adapter):
                state["p_values"][arm.adapter] = d.p_value
                _append_p(state, arm.adapter, d.p_value, len(obs[champion]["rewards"]), len(obs[arm.adapter]["rewards"]))
                changed = True
            if d.action == "promote" and cfg.auto_promote:
                return self.promote(name, arm.adapter, reason=d.reason, obs=obs)
            if d.action == "rollback" and cfg.auto_rollback:
                state["stopped_arms"].append(arm.adapter)
                state["decisions"].append({"time": time.time(), "action": "rollback", "arm": arm.adapter, "reason": d.reason})
                changed = True
        changed = self._end_if_over(cfg, state, obs) or changed
        if changed:
            self.saved.save(name, cfg.model_dump(), state)
        return self.status(name, obs)

    def _end_if_over(self, cfg: ExperimentConfig, state: dict[str, Any], obs: dict[str, dict[str, list[float]]]) -> bool:
        """End an experiment with nothing left to decide: every challenger rolled back, or ``max_samples`` or ``max_duration_s``
        reached undecided (then, with ``non_inferiority_margin``, the best non-inferior challenger is promoted)."""
        champion = state["champion"]
        live = [a.adapter for a in cfg.arms if a.adapter != champion and a.adapter not in state["stopped_arms"]]
        elapsed = time.time() - float(state["started_at"])
        if not live:
            status, reason = "rolled_back", "every challenger was rolled back: the champion stays"
        elif cfg.max_samples is not None and all(len(obs[a]["rewards"]) >= cfg.max_samples for a in [champion, *live]):
            status, reason = "inconclusive", f"no decision after {cfg.max_samples} rewards per arm: the champion stays"
        elif cfg.max_duration_s is not None and elapsed >= cfg.max_duration_s:
            counts = ", ".join(f"{a}: n = {len(obs[a]['rewards'])}" for a in [champion, *live])
            status, reason = "inconclusive", f"no decision after {cfg.max_duration_s:g} s ({counts}; {cfg.describe_sources()}): the champion stays"
        else:
            return False
        state["ended_at"] = time.time()
        winner, tested = _non_inferior_winner(cfg, champion, live, obs) if status == "inconclusive" else (None, [])
        if winner is not None:
            arm, why = winner
            self.registry.set_alias(cfg.family, arm)
            _record_effect(state, obs, arm)
            state.update(status="promoted", winner=arm)
            state["decisions"].append({"time": state["ended_at"], "action": "promote", "arm": arm, "reason": f"undecided at the end; {why}"})
            return True
        state["status"] = status
        if tested:  # what the non-inferiority test found, so the status says why the champion stays
            reason += "; " + "; ".join(tested)
        state["decisions"].append({"time": state["ended_at"], "action": "end", "arm": None, "reason": reason})
        return True

    def status(self, name: str, obs: dict[str, dict[str, list[float]]] | None = None) -> dict[str, Any]:
        cfg, state = self.configs[name], self._state(name)
        if obs is None:
            obs = self._observations(cfg, state)
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
                # what the decision compares: the rewards, or with several sources each standardized within its source
                "mean_score": _num(sum(o["scores"]) / len(o["scores"])) if o["scores"] else None,
                "ci95": [_num(s.ci_low), _num(s.ci_high)] if s else None,
                "requests": len(o["latency_s"]),
                "mean_latency_s": _num(sum(o["latency_s"]) / len(o["latency_s"])) if o["latency_s"] else None,
                "tokens_per_s": _num(sum(o["tokens_per_s"]) / len(o["tokens_per_s"])) if o["tokens_per_s"] else None,
            }
            if a.adapter != champion:
                row["msprt_p_value"] = state["p_values"].get(a.adapter, 1.0)
                if len(o["rewards"]) >= 2 and len(obs[champion]["rewards"]) >= 2:
                    t, p = welch_t_test(obs[champion]["scores"], o["scores"])
                    row["welch_t"], row["welch_p_fixed_horizon"] = _num(t), _num(p)
            arms.append(row)
        out = {"name": name, "config": cfg.model_dump(), **{k: v for k, v in state.items() if k != "p_values"}, "arms": arms}
        out["evidence"] = _evidence_note(cfg, state, arms)
        return out

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


def _score_within_source(obs: dict[str, dict[str, list[Any]]]) -> None:
    """Add each arm's ``scores``: its rewards, or, when the evidence holds several sources, each reward standardized within
    its source over every arm, ``(r - mean_s) / sd_s`` (a source with no spread scores 0: it tells the arms nothing).

    Sources differ in scale (a thumbs' -1/+1, a 0/1 check, a 1-5 rating) and users in which one they send, so a raw mean
    mixes them in whatever proportions the sticky split happened to give each arm: in a live run a challenger worse
    within both of its main sources had the higher raw mean, because it drew fewer of the -1 thumbs. Centering
    within source compares arms within each source (post-stratification), and scaling gives every source one unit,
    so the margin in standard deviations means the same for all."""
    sources = {x for o in obs.values() for x in o["sources"]}
    if len(sources) <= 1:
        for o in obs.values():
            o["scores"] = list(o["rewards"])
        return
    pooled: dict[str, list[float]] = {}
    for o in obs.values():
        for r, src in zip(o["rewards"], o["sources"], strict=True):
            pooled.setdefault(src, []).append(float(r))
    per_source = {src: (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) for src, xs in pooled.items()}
    for o in obs.values():
        o["scores"] = [
            (float(r) - per_source[src][0]) / per_source[src][1] if per_source[src][1] > 0 else 0.0
            for r, src in zip(o["rewards"], o["sources"], strict=True)
        ]


def _record_effect(state: dict[str, Any], obs: dict[str, dict[str, list[Any]]], arm: str) -> None:
    """The promoted arm's ``effect`` against the champion, in pooled sds (``standardized_effect``): a chain's next step.
    None when an arm has fewer than 2 scores or neither has any spread."""
    eff = standardized_effect(obs[state["champion"]]["scores"], obs[arm]["scores"]) if arm in obs and state["champion"] in obs else None
    state["effect"] = None if eff is None else {"arm": arm, "diff_sd": eff[0], "var_sd": eff[1]}


def _non_inferior_winner(
    cfg: ExperimentConfig, champion: str, live: list[str], obs: dict[str, dict[str, list[float]]]
) -> tuple[tuple[str, str] | None, list[str]]:
    """With ``non_inferiority_margin``: the live challenger with the highest mean among those shown non-inferior to the
    champion (each arm with at least ``min_samples`` rewards) and why, or None (the champion stays); and each tested
    arm's verdict in words. With ``non_inferiority_chain`` the test bounds the drift of the whole chain of promotions
    since its anchor."""
    if cfg.non_inferiority_margin is None or len(obs[champion]["rewards"]) < cfg.min_samples:
        return None, []
    chain = cfg.non_inferiority_chain
    prior = {"prior_diff_sd": chain.diff_sd, "prior_var_sd": chain.var_sd} if chain is not None else {}
    best: tuple[float, str, str] | None = None
    tested: list[str] = []
    for arm in live:
        if len(obs[arm]["rewards"]) < cfg.min_samples:
            continue
        t = non_inferiority(obs[champion]["scores"], obs[arm]["scores"], margin_sd=cfg.non_inferiority_margin, alpha=cfg.alpha, **prior)
        tested.append(f"{arm} {t.reason}")
        if t.passed and (best is None or t.diff > best[0]):
            best = (t.diff, arm, t.reason)
    return (None if best is None else (best[1], best[2])), tested


def _evidence_note(cfg: ExperimentConfig, state: dict[str, Any], arms: list[dict[str, Any]]) -> str:
    """What the experiment has to decide on, in words: says so when an arm has no evidence at all, and when it ends."""
    elapsed = time.time() - float(state["started_at"])
    empty = [a["adapter"] for a in arms if a["n"] == 0 and not a["stopped"]]
    counts = ", ".join(f"{a['adapter']} n = {a['n']}" for a in arms)
    line = f"{counts} ({cfg.describe_sources()}; at least {cfg.min_samples} per arm to decide)"
    if empty and state["status"] == "running":
        line = f"no evidence yet on {', '.join(empty)} after {elapsed:.0f} s: {line}"
    if state["status"] == "running" and cfg.max_duration_s is not None:
        line += f"; ends undecided in {max(0.0, cfg.max_duration_s - elapsed):.0f} s"
    return line


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


async def evaluate_forever(experiments: Experiments, every_s: float = 10.0) -> None:
    """Apply automatic promote/rollback decisions to running experiments."""
    while True:
        await asyncio.sleep(every_s)
        for name, state in list(experiments.states.items()):
            if state["status"] != "running":
                continue
            try:
                experiments.evaluate(name)  # on the loop: alias flips must not race the registry
            except Exception:  # one experiment's failure must not stop the others; retried next round
                log.exception("evaluating experiment %s failed", name)
