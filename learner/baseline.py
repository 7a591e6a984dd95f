"""A running baseline for one-off prompts: REINFORCE with a per-key baseline, so singleton groups still learn.

    adv, state = running_baseline(turn_samples, keys, state, decay=0.98, norm_by_std=True)

Live chat rarely repeats a prompt, so its groups (``learner.samples``: one per opening request) are
singletons, and a group estimator gives a lone reward advantage 0. Here every singleton trajectory is
compared with what the same *key* earned before: the key is the traffic kind (the agent, or ``chat``),
the client's tag and the reward source (a verifier's 0/1 and a user's thumbs never share a baseline), and,
by default, the owner (the API key that made the trajectory and whose user rated it).

**Per owner** (``per_owner``): users rate on their own scales and habits (one thumbs-ups nearly everything,
another is strict), so a baseline pooled over owners turns an owner's habit into advantage. In the live-traffic
benchmark one key of eight rates at random: its thumbs-ups (half of its ratings, about 6 % of all) are about as many
as the honest users' right answers (5-8 % of theirs), and a pooled baseline gave both the same large advantage. Against its own owner's mean, a
random rater's rewards are zero-mean (about +-1, uncorrelated with the reply) and a lenient rater's thumbs-up
is worth less (user-bias removal, as in collaborative filtering). While an owner has fewer than ``owner_min``
rewards under a key, the pooled key's baseline is used (both are updated with every reward).

The rule, per trajectory in the order given (oldest first; each trajectory once, its turns share the
advantage, as GRPO's trajectory score; ``x`` is its score, the sum of its reward stream):

    n == 0:  A = 0                                  (no baseline yet: the first reward only seeds it)
    else:    A = clip((x - m) / max(s, floor), -c, c)   if norm_by_std and s > 0,   else   A = clip(x - m, -c, c)
    then     a = max(1 / (n + 1), 1 - decay);  d = x - m;  m += a d;  v = (1 - a) (v + a d^2);  s = sqrt(v);  n += 1

``m`` and ``v`` are the key's exponentially weighted mean and variance (a plain average and population
variance over the first ``1 / (1 - decay)`` rewards, then an EMA). The state is kept across updates (in the
trainer's checkpoint), so the baseline carries over.

Bias and variance: the baseline of a trajectory never includes its own reward, only rewards of earlier,
independently sampled trajectories, so it does not depend on the sampled action and the policy gradient
stays unbiased (REINFORCE with baseline; Williams 1992; Sutton & Barto 2018, 13.4). The dividing ``max(s, floor)``
is a positive per-key scale, not a per-sample one, so the floor (``std_floor``, default 0.1) changes the step size
only, never its direction: without it one 0 after many 1s (``s`` near 0 but positive) gave about -10. While a key has
seen no spread at all (``s == 0``: one reward, or all equal) the raw difference ``x - m`` is used.

**Bounded**: ``|A| <= c`` (``clip``, default 3, about the largest ``|A|`` a GRPO group of ten has). The clip is the one
biased part: it bites only on a reward more than ``c`` floored stds from its key's mean, and there it shrinks that
trajectory's weight, trading a little bias on rare outliers (a key's first 0 after a run of 1s, a garbage reward)
for a bounded step, as PPO's ratio clip trades bias for stability (Schulman et al. 2017). The variance is higher than a per-prompt group mean's: the
baseline ignores how hard *this* prompt is (a hard prompt's reward lands below ``m`` whatever the answer),
and ``m`` lags a policy that is improving (its advantages then run positive until it catches up). More
traffic per key reduces both.

:func:`apply_to_singletons` puts it into an update: the group estimator's advantages stay for every group of two
or more trajectories, and each singleton trajectory's turns get the baseline advantage instead of the 0 a group
of one gets; :func:`singleton_advantages` does that as the ``[singletons]`` table (``learner.config.SingletonConfig``)
says, for the learner's updates and ``bench/replay_learning.py``'s alike.

Not here: the group estimators (``learner.advantages``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from learner.advantages import Advantages
    from learner.config import SingletonConfig
    from learner.samples import Sample

__all__ = [
    "GROUP_ESTIMATORS",
    "apply_to_singletons",
    "baseline_key",
    "owner_key",
    "running_baseline",
    "singleton_advantages",
    "trajectory_score",
]

# estimators that give a group of one trajectory advantage 0 (their baseline is the group): the baseline replaces that 0
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "gigpo", "turn_grpo")


def baseline_key(meta: dict[str, Any], tag: str | None, source: str | None) -> str:
    """``<agent or chat>|<tag or ->|<reward source>``: the traffic whose rewards one baseline averages."""
    return f"{meta.get('agent') or 'chat'}|{tag or '-'}|{source or '-'}"


def owner_key(pooled: str, owner: str | None) -> str:
    """The per-owner key under a pooled :func:`baseline_key`: ``<pooled>|owner:<owner or ->``."""
    return f"{pooled}|owner:{owner or '-'}"


def running_baseline(
    scores: Sequence[float],
    keys: Sequence[str],
    state: dict[str, dict[str, float]] | None,
    *,
    decay: float,
    norm_by_std: bool = True,
    std_floor: float = 0.1,
    clip: float = 3.0,
    fallback: Sequence[str] | None = None,
    min_n: int = 1,
) -> tuple[list[float], dict[str, dict[str, float]], list[bool]]:
    """One advantage per trajectory score (same order), the updated state, and per score whether its key had no baseline yet.

    ``state`` maps a key to ``{"n", "mean", "var"}``; it is copied, never changed in place. With ``fallback`` (one key per
    score, e.g. the pooled key above a per-owner one), a score whose own key has fewer than ``min_n`` rewards is compared
    with its fallback key's baseline instead; every score updates both keys."""
    if len(scores) != len(keys) or (fallback is not None and len(fallback) != len(keys)):
        raise ValueError(f"need one key (and fallback key) per score, got {len(keys)} keys for {len(scores)} scores")
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    if not (std_floor > 0.0 and clip > 0.0):
        raise ValueError(f"std_floor and clip must be positive, got {std_floor}, {clip}")
    out_state = {k: dict(v) for k, v in (state or {}).items()}
    adv: list[float] = []
    warmup: list[bool] = []
    for i, (x, key) in enumerate(zip(scores, keys, strict=True)):
        if not math.isfinite(x):
            raise ValueError(f"score {x!r} is not finite")
        own = out_state.setdefault(key, {"n": 0, "mean": 0.0, "var": 0.0})
        pooled = out_state.setdefault(fallback[i], {"n": 0, "mean": 0.0, "var": 0.0}) if fallback is not None else None
        use = own if pooled is None or own["n"] >= min_n else pooled
        n, m, v = int(use["n"]), float(use["mean"]), float(use["var"])
        warmup.append(n == 0)
        if n == 0:
            adv.append(0.0)
        else:
            a_raw = (x - m) / max(math.sqrt(v), std_floor) if norm_by_std and v > 0.0 else x - m  # v == 0: no spread seen yet
            adv.append(min(clip, max(-clip, a_raw)))
        for st in (own,) if pooled is None or pooled is own else (own, pooled):
            n, m, v = int(st["n"]), float(st["mean"]), float(st["var"])
            a = max(1.0 / (n + 1), 1.0 - decay)
            d = x - m
            st.update(n=n + 1, mean=m + a * d, var=(1.0 - a) * (v + a * d * d))
    return adv, out_state, warmup


def trajectory_score(samples: Sequence[Sample]) -> float | None:
    """The reward stream's sum of one trajectory's samples (``learner.advantages``: turn rewards plus the outcome)."""
    given = [s.reward for s in samples if s.reward is not None]
    outcome = samples[0].trajectory_reward
    if not given and outcome is None:
        return None
    return sum(given) + (outcome or 0.0)


def apply_to_singletons(
    samples: Sequence[Sample],
    advantages: Advantages,
    state: dict[str, dict[str, float]] | None,
    *,
    decay: float,
    norm_by_std: bool,
    std_floor: float = 0.1,
    clip: float = 3.0,
    per_owner: bool = False,
    owner_min: int = 8,
) -> tuple[Advantages, dict[str, dict[str, float]], set[str]]:
    """The estimator's ``advantages`` with every singleton trajectory's turns set to its running-baseline advantage.

    Singleton trajectories are taken oldest first (by their last turn), each once. Returns the new advantages (stats:
    the singletons that got a baseline no longer count as zero-spread groups), the new state, and the ids of the
    trajectories whose key had no baseline yet (advantage 0)."""
    from learner.advantages import Advantages

    by_group: dict[str, dict[str, list[int]]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id, {}).setdefault(s.trajectory_id, []).append(i)
    singles: list[tuple[float, str, float, list[int], str]] = []  # (last turn time, pooled key, score, sample indices, owner key)
    for trajs in by_group.values():
        if len(trajs) != 1:
            continue
        [idx] = trajs.values()
        members = [samples[i] for i in idx]
        score = trajectory_score(members)
        if score is None or not math.isfinite(score):
            continue
        first = members[0]
        source = first.trajectory_reward_source or next((m.reward_source for m in members if m.reward_source), None)
        pooled = baseline_key(first.meta, first.meta.get("tag"), source)
        singles.append((max(m.created_at for m in members), pooled, score, idx, owner_key(pooled, first.owner)))
    singles.sort(key=lambda t: t[0])
    pooled_keys = [t[1] for t in singles]
    adv, new_state, warm = running_baseline(
        [t[2] for t in singles],
        [t[4] for t in singles] if per_owner else pooled_keys,
        state,
        decay=decay,
        norm_by_std=norm_by_std,
        std_floor=std_floor,
        clip=clip,
        fallback=pooled_keys if per_owner else None,
        min_n=owner_min if per_owner else 1,
    )
    values = list(advantages)
    warmup: set[str] = set()
    for (_, _, _, idx, _), a, w in zip(singles, adv, warm, strict=True):
        for i in idx:
            values[i] = a
        if w:
            warmup.add(samples[idx[0]].trajectory_id)
    seeded = sum(1 for w in warm if not w)
    stats = dataclasses.replace(advantages.stats, n_zero_std_groups=max(0, advantages.stats.n_zero_std_groups - seeded))
    return Advantages(values, stats), new_state, warmup


def singleton_advantages(
    samples: Sequence[Sample],
    advantages: Advantages,
    state: dict[str, dict[str, float]] | None,
    cfg: SingletonConfig,
    estimator: str,
) -> tuple[Advantages, dict[str, dict[str, float]], set[str]] | None:
    """:func:`apply_to_singletons` with the ``[singletons]`` table's baseline settings, or None where it does not apply.

    It applies in the ``baseline`` and ``complete`` modes (``complete``: to the singletons it did not complete) and only
    under a group estimator (:data:`GROUP_ESTIMATORS`); otherwise the caller keeps the estimator's advantages and state."""
    if cfg.mode not in ("baseline", "complete") or estimator not in GROUP_ESTIMATORS:
        return None
    return apply_to_singletons(
        samples,
        advantages,
        state,
        decay=cfg.baseline_decay,
        norm_by_std=cfg.baseline_norm_by_std,
        std_floor=cfg.baseline_std_floor,
        clip=cfg.baseline_clip,
        per_owner=cfg.baseline_per_owner,
        owner_min=cfg.baseline_owner_min,
    )
