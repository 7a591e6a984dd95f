"""Why an update learned little or nothing: counts of what it could not use, each with a reason in words.

    why = unused_reasons(skipped, samples, advantages, singleton_mode="baseline")
    why["top"]      # "one-off prompts: ..." -- the reason that cost the most turns, or None when everything trained
    why["counts"]   # {"singleton": 7, "stale": 3, ...}: turns per reason (rewards for other_source)

Two kinds of loss are counted, in turns: what the sample builder left out (``learner.samples.SkipCounts``:
no reward, stale, another family or traffic, still settling, ...) and samples that reached the estimator
but got advantage 0: a group of one trajectory (``singleton``: a one-off prompt, when ``[singletons]``
does not give it a baseline; ``baseline_warmup``: the running baseline's first reward of its key) or a
group whose rewards are all equal (``equal_rewards``). The learner service puts the result in each
update's history line and ``status.json`` (``GET /admin/learner``), and says the top reason in its status
line and log when an update did not train.

Not here: the counting itself (``learner.samples``, ``learner.advantages``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from learner.baseline import trajectory_score
from learner.samples import Sample

__all__ = ["REASONS", "unused_reasons"]

# reason key -> words; the keys of SkipCounts that lose data, plus the estimator-side ones
REASONS: dict[str, str] = {
    "no_reward": "no reward from a training source (feedback, verifier, judge or hook; see [samples] reward_sources)",
    "singleton": "one-off prompts: a group of one trajectory has nothing to compare with (set [singletons] mode = 'baseline')",
    "baseline_warmup": "the running baseline's first reward for its key only seeds the baseline",
    "equal_rewards": "equal rewards within each group: nothing to prefer",
    "at_group_mean": "a reward exactly at its group's mean (advantage 0 by definition; nothing is lost)",
    "excluded": "unscorable rewards (NaN) in the estimator",
    "stale": "stale: produced by a version more than max_staleness updates older than the trainer's",
    "other_family": "produced by another adapter family",
    "other_traffic": "outside this learner's traffic filter ([traffic]: agent, chat, model, tag)",
    "other_owner": "made by an API key outside [samples] owners",
    "other_source": "rewards from a lower-ranked source than the group's best (one source per group)",
    "deferred_trajectories": "still settling (last turn newer than settle_s)",
    "untrainable": "agent runs that broke the prefix invariant",
    "grammar_unrecorded": "constrained turns recorded without their grammar",
    "sampling_penalties": "turns sampled with presence/frequency penalties or logit_bias (the trainer cannot reproduce their logprobs)",
    "no_tokens": "turns without output tokens to train on",
    "surplus": "beyond max_trajectories for one update",
    "after_last_reward": "turns after the last rated turn of a conversation (nobody judged them; rate the last reply or the trajectory)",
    "owner_share": "over one API key's share of the update ([samples] max_owner_share)",
    "quarantined": "trajectories of a batch that failed the learner twice (quarantine.json)",
}
# skips that lose nothing (evaluation runs, re-rollouts trained by the update that asked for them, T2PO drafts): not reasons


def unused_reasons(
    skipped: Mapping[str, int], samples: Sequence[Sample], advantages: Sequence[float], *, warmup: Collection[str] = ()
) -> dict[str, Any]:
    """``{"counts": {reason: n}, "top": words | None, "top_key": key | None, "trained": n}`` for one update.

    ``advantages`` are the final ones (after any singleton baseline); ``warmup`` holds the trajectory ids whose
    running baseline was not seeded yet (``learner.baseline``). A zero-advantage turn counts as ``baseline_warmup``
    if its trajectory is in ``warmup``, else ``singleton`` if its group has one trajectory, else ``equal_rewards`` if its
    group's scores are all equal, else ``at_group_mean`` (its score is the group's mean: 0 by definition)."""
    counts: dict[str, int] = {k: int(v) for k, v in skipped.items() if k in REASONS and v}
    trajs: dict[str, set[str]] = {}
    members: dict[str, list[Sample]] = {}
    for s in samples:
        trajs.setdefault(s.group_id, set()).add(s.trajectory_id)
        members.setdefault(s.trajectory_id, []).append(s)
    scores: dict[str, set[float | None]] = {}
    for ss in members.values():
        scores.setdefault(ss[0].group_id, set()).add(trajectory_score(ss))
    for s, a in zip(samples, advantages, strict=True):
        if a != 0.0:
            continue
        if s.trajectory_id in warmup:
            key = "baseline_warmup"
        elif len(trajs[s.group_id]) == 1:
            key = "singleton"
        elif len(scores[s.group_id]) == 1:
            key = "equal_rewards"
        else:
            key = "at_group_mean"
        counts[key] = counts.get(key, 0) + 1
    trained = sum(1 for a in advantages if a != 0.0)
    top_key = max(counts, key=lambda k: counts[k]) if counts else None
    return {"counts": counts, "top_key": top_key, "top": REASONS[top_key] if top_key else None, "trained": trained}
