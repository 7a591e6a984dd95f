"""Every trajectory shape users produce has a defined reward and a bounded advantage (property-based, ``hypothesis``).

Generated traffic, written into a real SQLite interaction store the way the recorder writes it: stitched multi-turn
chats (each turn's context is the previous context, the previous reply and the next user message), ``n > 1`` sibling
trajectories of one opening request, regenerate/edit branches (a new trajectory whose first turn has a
``parent_turn_id``), tool-call turns, aborted turns (cut short, possibly without a trainable token), agent runs with a
task key, per-turn process scores and an outcome; several API keys and the learner's own runs; rewards on any turn,
on the trajectory, on several targets or on none, from any mix of sources (a verifier, a judge, a hook, feedback under
the names clients give it, a garbage key's wild values). For each generated store: ``collect_samples`` → every
registered estimator (+ the running baseline for one-off prompts) → a real ``LoRATrainer`` step on the tiny model.

Properties (the rule in ``learner/samples.py``'s docstring and "How feedback trains" in ``docs/learning.md``):
* nothing raises; every advantage is finite, and bounded by what the estimator's definition allows (a z-score of G
  values is at most ``(G - 1) / sqrt(G)``; a centred rank in [-1/2, 1/2]; the baseline's clip);
* every kept turn is judged: its trajectory has an outcome, or a rated turn at or after it; the turns after a
  trajectory's last rating are left out (``after_last_reward``) unless it has an outcome;
* one reward source per group, ranked once across turn and trajectory rewards (a task's own ``:process`` scores
  beside their outcome excepted);
* no API key makes up more than ``max(max_owner_share, 1/K)`` of the kept trajectories (the learner's runs are no key).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from learner.advantages import ADVANTAGES
from learner.baseline import apply_to_singletons
from learner.config import DEFAULT_REWARD_SOURCES, SampleConfig
from learner.records import PROCESS_SUFFIX, Reward, Turn, source_rank
from learner.records.store import SqliteStore
from learner.samples import Cursor, Sample, collect_samples, make_groups
from learner.update import estimate

NOW = 50_000.0
OWNERS = ["key-alice", "key-bob", "key-carol", "admin"]
SOURCES = ["feedback", "user", "thumbs", None, "verifier:calc", "judge:tiny", "hook:mine", "garbage"]
SHARE = 0.5


@st.composite
def reward_spec(draw: st.DrawFn, n_turns: int, agent: bool) -> list[tuple[str, int | None, float, str]]:
    """Rewards of one trajectory: (target kind, turn index or None for the trajectory, value, source)."""
    out: list[tuple[str, int | None, float, str]] = []
    for _ in range(draw(st.integers(0, 3))):
        on_turn = draw(st.booleans())
        idx = draw(st.integers(0, n_turns - 1)) if on_turn else None
        src = draw(st.sampled_from(SOURCES))
        value = draw(st.one_of(st.sampled_from([0.0, 1.0, -1.0]), st.floats(-100, 100, allow_nan=False, allow_infinity=False)))
        out.append(("turn" if on_turn else "trajectory", idx, value, src or "feedback"))
    if agent and draw(st.booleans()):  # an agent run: its verifier's outcome and per-turn process scores
        out.append(("trajectory", None, float(draw(st.booleans())), "verifier:calc"))
        for i in range(n_turns):
            if draw(st.booleans()):
                out.append(("turn", i, draw(st.floats(0, 1)), "verifier:calc" + PROCESS_SUFFIX))
    return out


@st.composite
def traffic(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Conversations: their shape, owner, turns and rewards."""
    convs: list[dict[str, Any]] = []
    n_prompts = draw(st.integers(1, 4))
    for c in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["chat", "chat", "siblings", "branch", "agent", "tools"]))
        n_turns = draw(st.integers(1, 5))
        siblings = draw(st.integers(2, 4)) if kind == "siblings" else 1
        convs.append(
            {
                "kind": kind,
                "prompt": draw(st.integers(0, n_prompts - 1)),
                "owner": draw(st.sampled_from(OWNERS)),
                "turns": n_turns,
                "siblings": siblings,
                "aborted": draw(st.sampled_from([None, "empty", "cut"])),
                "adapter": draw(st.sampled_from([None, "chat-lora@1", "chat-lora@2"])),
                "rewards": [draw(reward_spec(n_turns, kind == "agent")) for _ in range(siblings)],
                "t0": 1_000.0 + 100.0 * c,
            }
        )
    return convs


def _turn(tid: str, traj: str, i: int, context: list[int], output: list[int], **kw: Any) -> Turn:
    return Turn(
        turn_id=tid,
        trajectory_id=traj,
        session_id=f"s-{traj}",
        index=i,
        completion_id=f"c-{tid}",
        model="tiny",
        context_ids=context,
        output_ids=output,
        logprobs=[-1.0] * len(output),
        loss_mask=[1] * len(output),
        **kw,
    )


def record(store: SqliteStore, convs: list[dict[str, Any]]) -> None:
    """Write the generated conversations as the recorder would: stitched contexts, one trajectory per choice."""
    first_turns: list[Turn] = []
    for c, conv in enumerate(convs):
        for k in range(conv["siblings"]):
            traj = f"tr-{c}-{k}"
            context = [1, 5 + conv["prompt"], 9]  # the opening request: same prompt, same context (a group)
            turns: list[Turn] = []
            parent = first_turns[c % len(first_turns)].turn_id if conv["kind"] == "branch" and first_turns else None
            if parent is not None:
                context = [1, 7, 7, 5 + conv["prompt"], 11]  # an edited earlier message: a branch with its own context
            for i in range(conv["turns"]):
                last = i == conv["turns"] - 1
                output = [20 + (c * 7 + k * 3 + i) % 90, 30 + i, 2]
                if last and conv["aborted"] == "empty":
                    output = []
                elif last and conv["aborted"] == "cut":
                    output = output[:1]
                tool_calls = [{"id": f"call-{c}-{i}", "name": "calc", "arguments": "{}"}] if conv["kind"] == "tools" and not last else []
                turns.append(
                    _turn(
                        f"{traj}-t{i}",
                        traj,
                        i,
                        list(context),
                        output,
                        created_at=conv["t0"] + i,
                        owner=conv["owner"],
                        adapter=conv["adapter"],
                        parent_turn_id=parent if i == 0 else f"{traj}-t{i - 1}",
                        choice_index=k if i == 0 else 0,
                        prefix_key=f"p{conv['prompt']}" if i == 0 and parent is None else "",
                        sampling={"temperature": 0.7 if k else 0.0},
                        finish_reason="abort" if last and conv["aborted"] else ("tool_calls" if tool_calls else "stop"),
                        tool_calls=tool_calls,
                    )
                )
                context = context + output + [40 + i, 41]  # the next request: what it saw, its reply, the next message
            store.append_turns(turns)
            if k == 0:
                first_turns.append(turns[0])
            if conv["kind"] == "agent":
                store.set_trajectory_meta(traj, {"agent": "calc-agent", "task": "calc", "task_key": f"calc:{conv['prompt']}"})
            for target, idx, value, source in conv["rewards"][k]:
                target_id = traj if target == "trajectory" else f"{traj}-t{idx}"
                store.add_reward(Reward(target=target, target_id=target_id, value=value, source=source, owner=conv["owner"], created_at=NOW - 1))


@pytest.fixture(scope="module")
def trainer(tiny_model_path: Path) -> Any:
    from learner.config import LoRAConfig, TrainerConfig
    from learner.trainer import LoRATrainer

    return LoRATrainer(tiny_model_path, TrainerConfig(lr=1e-4, progress=False), LoRAConfig(rank=2, alpha=4, target_modules=["q_proj"]))


def check_rule(samples: list[Sample], counts: dict[str, int]) -> None:
    by_traj: dict[str, list[Sample]] = {}
    for s in samples:
        by_traj.setdefault(s.trajectory_id, []).append(s)
    for traj_samples in by_traj.values():
        outcome = traj_samples[0].trajectory_reward
        rated = [s.turn_index for s in traj_samples if s.reward is not None]
        assert outcome is not None or rated, "a kept trajectory has a reward"
        if outcome is None:  # judged up to its last rated turn: nothing after it is kept
            assert max(s.turn_index for s in traj_samples) == max(rated)
    for g in make_groups(samples):  # one rank per group, across turn and trajectory rewards
        ranks = set()
        for s in g.samples:
            if s.trajectory_reward_source is not None:
                ranks.add(source_rank(s.trajectory_reward_source, DEFAULT_REWARD_SOURCES))
            process = s.trajectory_reward_source is not None and s.reward_source == s.trajectory_reward_source + PROCESS_SUFFIX
            if s.reward_source is not None and not process:
                ranks.add(source_rank(s.reward_source, DEFAULT_REWARD_SOURCES))
        assert len(ranks) <= 1, f"group {g.group_id} mixes source ranks {ranks}"
    owners: dict[str, set[str]] = {}
    for s in samples:
        if s.owner != "admin":
            owners.setdefault(s.owner or "", set()).add(s.trajectory_id)
    total = sum(len(v) for v in owners.values())
    for ts in owners.values():
        assert len(ts) <= max(SHARE, 1 / len(owners)) * total + 1e-9


def check_bounded(name: str, samples: list[Sample], adv: list[float]) -> None:
    a = np.asarray(adv, dtype=np.float64)
    assert np.isfinite(a).all(), f"{name}: non-finite advantages {adv}"
    n_traj = len({s.trajectory_id for s in samples})
    n = max(len(samples), n_traj, 1)
    if name in ("grpo", "rtpo"):
        # a z-score (ddof=1) of G values is at most (G - 1)/sqrt(G) in size; RTPO's sibling sets are subsets
        assert np.abs(a).max(initial=0.0) <= (n - 1) / math.sqrt(n) + 1e-6
    elif name == "rank":
        assert np.abs(a).max(initial=0.0) <= 0.5
    elif name == "gigpo":  # the episode and the step level, each a z-score over at most n turn samples
        assert np.abs(a).max(initial=0.0) <= 2 * (n - 1) / math.sqrt(n) + 1e-6
    else:  # unnormalised (drgrpo, rloo) or TCPO's normalised credit: finite, and no larger than the rewards allow
        scale = 1.0 + max((abs(s.reward or 0.0) + abs(s.trajectory_reward or 0.0)) for s in samples) * 6 if samples else 1.0
        assert np.abs(a).max(initial=0.0) <= scale * n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(convs=traffic())
def test_every_shape_collects_estimates_and_steps(convs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory, trainer: Any) -> None:
    store = SqliteStore(tmp_path_factory.mktemp("shapes") / "interactions.db")
    try:
        record(store, convs)
        batch = collect_samples(
            store, family="chat-lora", cursor=Cursor(), cfg=SampleConfig(settle_s=0, max_owner_share=SHARE), current_version=2, now=NOW
        )
    finally:
        store.close()
    samples = batch.samples
    event(f"kept trajectories: {min(len({s.trajectory_id for s in samples}), 5)}+")
    event(f"multi-turn kept: {any(s.turn_index > 0 for s in samples)}")
    for reason in ("after_last_reward", "other_source", "owner_share", "no_tokens", "no_reward"):
        if getattr(batch.counts, reason):
            event(f"skipped: {reason}")
    check_rule(samples, batch.counts.as_dict())
    for name in ADVANTAGES:
        adv = estimate(samples, name)
        check_bounded(name, samples, list(adv))
    adv = estimate(samples, "grpo")
    final, _, _ = apply_to_singletons(samples, adv, None, decay=0.98, norm_by_std=True)
    assert all(math.isfinite(x) for x in final)
    singles = {g.trajectory_ids[0] for g in make_groups(samples) if len(g.trajectory_ids) == 1}
    assert all(abs(x) <= 3.0 for s, x in zip(samples, final, strict=True) if s.trajectory_id in singles)  # the baseline's clip
    m = trainer.step(samples, final, skipped=batch.counts.as_dict())
    assert math.isfinite(m.loss) and math.isfinite(m.reward_mean) and m.trained_samples == sum(1 for x in final if x != 0.0 and samples)
