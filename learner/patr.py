"""PATR tree rollouts: one problem's group grown as a tree over turns, forked where a process scorer ranks highest.

    tree = grow_tree(RuntimeStepper(url, key, agent="fl", task="frozenlake", problem_index=3, seed=0, tree="t1"), PatrConfig(), rng)
    adv = tree_advantages(tree)        # node id -> advantage (shared-prefix turns: one sample, one advantage)
    tree.leaves, tree.budget           # the group, and the sampled tokens / tool calls / runs it cost

PATR ("Process Reward Informed Tree Rollout for Effective Multi-Turn RL", ACL ARR 2026, OpenReview
mj6Ho1bjY5; only its abstract is public, so the rules below are this project's reading of it):

1. ``roots`` root paths start from the problem, each **advancing one turn at a time**: every advance is a
   runs-endpoint *segment* (``segment.turns`` = ``advance_turns``) that continues a path through the
   runtime's exact-prefix replay (``branch`` of kind ``patr`` at the path's end: the recorded turns are
   replayed, never re-tokenized or re-run, the environment is stepped with the recorded outputs, and
   the observation after the last recorded turn is the one recorded when that segment paused); the
   segment samples the next turn(s) with the policy and pauses again, or the run ends (environment done,
   the stop policy's answer, the turn cap) and the task's verifier rewards it.
2. After every advance each live path's prefix is scored by the task's process scorer (``score_prefix``,
   computed by the runtime where the task lives: FrozenLake's progress/validity/not-in-a-hole, calc_arith's
   share of intermediate results reached).
3. At each fork point (every ``fork_every`` turns, at most ``fork_rounds`` times, while the tree's budget of
   sampled tokens ``max_tokens`` and tool calls ``max_tool_calls`` lasts) the ``fork_top`` highest-ranked live
   paths (ties: the older path) advance with ``branch`` children instead of one, as long as the tree stays
   within ``leaves`` paths in all (each live path ends as exactly one leaf, so a fork adds ``branch - 1``).
   The children share the parent's recorded prefix.
4. **Conservative stops** (each path ends early, as a leaf with ``stop_reward``, only when clearly
   degenerate): the same action ``repeat_n`` times in a row without the process score rising over them;
   ``invalid_n`` unreadable actions in a row; a process score at or below ``score_floor`` for ``floor_k``
   consecutive advances.
5. The leaves (finished and stopped paths) are the group.

**Advantage** (TreeRL-style, Hou et al. 2025, arXiv 2506.11902): GRPO over the leaves,
``A_l = (R_l - mean R) / (std R + eps)`` (sample std, as ``learner.advantages.grpo``); every tree node
(a recorded segment: its turns are stored once, whatever the number of leaves below it) gets the mean
of the leaf advantages below it, i.e. ``(V(node) - V(root)) / std`` with ``V`` the mean leaf reward
under a node. Shared-prefix tokens are therefore one sample with one advantage: a turn above every leaf
gets 0 (it separated nothing), a turn above a subset is credited by how its subtree did. With
``branch = 1`` (no forks) each path is one leaf and this is trajectory GRPO over ``roots`` paths.

Budget (reported per tree and summed per update): sampled tokens (replayed turns are free), tool calls of
sampled turns, runs, forks, stops by rule, failed runs.

Not here: the runs endpoint's segment/continuation (``agents/loop.py``, ``agents/host.py``), the trainer.
Importing this module does not import torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import structlog

from learner.records import Trajectory

log = structlog.get_logger(__name__)

__all__ = [
    "Budget",
    "Node",
    "NodeRun",
    "PatrConfigLike",
    "RuntimeStepper",
    "Stepper",
    "Tree",
    "action_key",
    "degenerate",
    "grow_tree",
    "tree_advantages",
]


class PatrConfigLike(Protocol):
    """What :func:`grow_tree` reads (``learner.config.PatrConfig``)."""

    leaves: int
    roots: int
    branch: int
    fork_every: int
    fork_rounds: int
    fork_top: int
    max_tokens: int | None
    max_tool_calls: int | None
    repeat_n: int
    invalid_n: int
    score_floor: float
    floor_k: int
    stop_reward: float


@dataclass
class NodeRun:
    """What one segment run gave (the runs endpoint's answer, reduced)."""

    trajectory_id: str | None
    turns: int  # sampled turns in this segment
    done: bool  # the run ended (verified); False = paused, the path goes on
    reward: float | None = None
    prefix_score: float | None = None
    actions: list[str] = field(default_factory=list)  # action keys of the sampled turns (action_key)
    tokens: int = 0  # sampled tokens
    tool_calls: int = 0
    error: str | None = None


@dataclass
class Node:
    id: int
    parent: int | None
    depth: int  # turns on the path up to and including this node
    run: NodeRun
    children: list[int] = field(default_factory=list)
    stopped: str | None = None  # the degeneracy rule that ended the path here
    leaf_reward: float | None = None  # set on leaves


@dataclass
class Budget:
    tokens: int = 0
    tool_calls: int = 0
    runs: int = 0
    forks: int = 0
    stopped: int = 0
    failed: int = 0

    def add(self, other: Budget) -> None:
        for k in ("tokens", "tool_calls", "runs", "forks", "stopped", "failed"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Tree:
    nodes: dict[int, Node] = field(default_factory=dict)
    leaves: list[int] = field(default_factory=list)
    fork_points: list[int] = field(default_factory=list)  # node ids that were forked, in order
    budget: Budget = field(default_factory=Budget)

    def path(self, node_id: int) -> list[Node]:
        out: list[Node] = []
        nid: int | None = node_id
        while nid is not None:
            out.append(self.nodes[nid])
            nid = self.nodes[nid].parent
        return out[::-1]

    def leaves_below(self, node_id: int) -> list[int]:
        stack, out = [node_id], []
        while stack:
            n = self.nodes[stack.pop()]
            if n.leaf_reward is not None and n.id in self.leaves:
                out.append(n.id)
            stack.extend(n.children)
        return out

    def summary(self) -> dict[str, Any]:
        rewards = [self.nodes[i].leaf_reward for i in self.leaves]
        return {
            "nodes": len(self.nodes),
            "leaves": len(self.leaves),
            "forks": len(self.fork_points),
            "leaf_rewards": rewards,
            **self.budget.as_dict(),
        }


class Stepper(Protocol):
    """Advances paths: one segment run per ``(parent, sample_seed)``; ``parent`` None starts a root."""

    def advance(self, requests: Sequence[tuple[Node | None, int]]) -> list[NodeRun]: ...


def degenerate(path: Sequence[Node], cfg: PatrConfigLike) -> str | None:
    """The conservative stop rule a path meets (module docstring, 4.), or None."""
    actions = [a for n in path for a in n.run.actions]
    scores = [n.run.prefix_score for n in path]
    if cfg.repeat_n > 0 and len(actions) >= cfg.repeat_n and len(set(actions[-cfg.repeat_n :])) == 1 and actions[-1] != "invalid":
        # the score before the streak started: the node whose turns end just before the last repeat_n actions
        before = _score_before(path, len(actions) - cfg.repeat_n)
        last = scores[-1]
        if last is not None and before is not None and last <= before:  # no score to compare with: not clearly degenerate
            return f"repeated the same action {cfg.repeat_n} times without progress"
    if cfg.invalid_n > 0 and len(actions) >= cfg.invalid_n and all(a == "invalid" for a in actions[-cfg.invalid_n :]):
        return f"{cfg.invalid_n} unreadable actions in a row"
    if cfg.floor_k > 0 and len(scores) >= cfg.floor_k and all(s is not None and s <= cfg.score_floor for s in scores[-cfg.floor_k :]):
        return f"process score <= {cfg.score_floor} for {cfg.floor_k} advances"
    return None


def _score_before(path: Sequence[Node], n_actions: int) -> float | None:
    """The prefix score after the first ``n_actions`` actions of the path (None before the first node: no score yet)."""
    seen = 0
    score: float | None = None
    for n in path:
        if seen + len(n.run.actions) > n_actions:
            return score
        seen += len(n.run.actions)
        score = n.run.prefix_score
    return score


def grow_tree(stepper: Stepper, cfg: PatrConfigLike, rng: random.Random) -> Tree:
    """Grow one problem's tree (module docstring, 1.-5.)."""
    tree = Tree()
    next_id = 0

    def add(parent: Node | None, run: NodeRun) -> Node | None:
        nonlocal next_id
        tree.budget.runs += 1
        tree.budget.tokens += run.tokens
        tree.budget.tool_calls += run.tool_calls
        if run.error is not None or run.trajectory_id is None:
            tree.budget.failed += 1
            return None
        node = Node(next_id, parent.id if parent else None, (parent.depth if parent else 0) + run.turns, run)
        next_id += 1
        tree.nodes[node.id] = node
        if parent is not None:
            parent.children.append(node.id)
        return node

    def seed() -> int:
        return rng.randrange(1, 2**31 - 1)

    roots = min(cfg.roots, cfg.leaves)
    live: list[Node] = []
    for run in stepper.advance([(None, seed()) for _ in range(roots)]):
        node = add(None, run)
        if node is not None:
            live.append(node)
    fork_rounds = 0
    while live:
        still: list[Node] = []
        for node in live:  # classify: finished, degenerate, or live
            if node.run.done:
                node.leaf_reward = float(node.run.reward) if node.run.reward is not None and math.isfinite(node.run.reward) else 0.0
                tree.leaves.append(node.id)
                continue
            reason = degenerate(tree.path(node.id), cfg)
            if reason is not None:
                node.stopped, node.leaf_reward = reason, cfg.stop_reward
                tree.leaves.append(node.id)
                tree.budget.stopped += 1
                continue
            still.append(node)
        live = still
        if not live:
            break
        forks: set[int] = set()
        over_budget = (cfg.max_tokens is not None and tree.budget.tokens >= cfg.max_tokens) or (
            cfg.max_tool_calls is not None and tree.budget.tool_calls >= cfg.max_tool_calls
        )
        at_point = any(n.depth % cfg.fork_every == 0 for n in live)
        if cfg.branch > 1 and fork_rounds < cfg.fork_rounds and not over_budget and at_point:
            projected = len(tree.leaves) + len(live)
            ranked = sorted((n for n in live if n.depth % cfg.fork_every == 0), key=lambda n: (-(n.run.prefix_score or 0.0), n.id))
            for n in ranked[: cfg.fork_top]:
                if projected + cfg.branch - 1 > cfg.leaves:
                    break
                forks.add(n.id)
                projected += cfg.branch - 1
            if forks:
                fork_rounds += 1
                tree.fork_points += sorted(forks, key=lambda i: [n.id for n in ranked].index(i))
                tree.budget.forks += len(forks)
        requests = [(n, seed()) for n in live for _ in range(cfg.branch if n.id in forks else 1)]
        runs = stepper.advance(requests)
        live = [c for (parent, _), run in zip(requests, runs, strict=True) if parent is not None and (c := add(parent, run)) is not None]
    return tree


def tree_advantages(tree: Tree, eps: float = 1e-6, zero_std_tol: float = 1e-9) -> dict[int, float]:
    """Node id -> advantage: GRPO over the leaves, each node the mean of the leaf advantages below it (module docstring)."""
    leaves = [i for i in tree.leaves if tree.nodes[i].leaf_reward is not None]
    rewards = [float(tree.nodes[i].leaf_reward) for i in leaves]  # type: ignore[arg-type]
    if len(rewards) < 2:
        return dict.fromkeys(tree.nodes, 0.0)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    if std <= zero_std_tol * max(1.0, max(abs(r) for r in rewards)):
        return dict.fromkeys(tree.nodes, 0.0)
    leaf_adv = {i: (r - mean) / (std + eps) for i, r in zip(leaves, rewards, strict=True)}
    out: dict[int, float] = {}
    for nid in tree.nodes:
        below = [leaf_adv[i] for i in tree.leaves_below(nid) if i in leaf_adv]
        out[nid] = sum(below) / len(below) if below else 0.0
    return out


# ---- the runtime side: segments through the admin runs endpoint -----------------------------------------


def action_key(step: dict[str, Any]) -> str:
    """A sampled turn's action as the degeneracy rules compare them: the environment's move (``info.moves``), an
    unreadable action (``info.format_error``), the tool calls, else the whitespace-normalised text."""
    info = step.get("info") or {}
    if info.get("format_error"):
        return "invalid"
    moves = info.get("moves")
    if isinstance(moves, str) and moves:
        return f"move:{moves[-1]}"
    calls = step.get("tool_calls") or []
    if calls:
        return "tool:" + json.dumps([[c.get("name"), c.get("arguments")] for c in calls], sort_keys=True)
    return "text:" + " ".join(str(step.get("text") or "").split())[:300]


def node_run(answer: dict[str, Any]) -> NodeRun:
    """A runs-endpoint answer as a :class:`NodeRun` (only the sampled, not the replayed, steps count)."""
    sampled = [s for s in answer.get("steps", []) if not s.get("replayed")]
    reward = answer.get("reward")
    score = answer.get("prefix_score")
    return NodeRun(
        trajectory_id=answer.get("trajectory_id") if sampled else None,
        turns=len(sampled),
        done=answer.get("stop_reason") != "paused",
        reward=float(reward) if isinstance(reward, int | float) else None,
        prefix_score=float(score) if isinstance(score, int | float) else None,
        actions=[action_key(s) for s in sampled],
        tokens=int(answer.get("completion_tokens") or 0),
        tool_calls=sum(len(s.get("tool_calls") or []) for s in sampled),
        error=None if sampled else f"no sampled turn (stop reason {answer.get('stop_reason')!r})",
    )


class RuntimeStepper:
    """:class:`Stepper` over ``POST /admin/agents/{agent}/runs`` segments of one problem (module docstring, 1.)."""

    def __init__(
        self,
        base_url: str,
        admin_key: str | None,
        *,
        agent: str,
        task: str | None,
        problem_index: int,
        seed: int,
        tree: str,
        model: str | None = None,
        advance_turns: int = 1,
        concurrency: int = 8,
        timeout_s: float = 900.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.client = client  # a synchronous client (e.g. an in-process app's); None = async HTTP to base_url, concurrently
        self.base_url, self.agent, self.task = base_url.rstrip("/"), agent, task
        self.problem_index, self.seed, self.tree, self.model = problem_index, seed, tree, model
        self.advance_turns, self.concurrency, self.timeout_s = advance_turns, concurrency, timeout_s
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    def body(self, parent: Node | None, sample_seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "problem_index": self.problem_index,
            "seed": self.seed,
            "sample_seed": sample_seed,
            "segment": {"tree": self.tree, "turns": self.advance_turns},
        }
        if self.task is not None:
            body["task"] = self.task
        if self.model is not None:
            body["model"] = self.model
        if parent is not None:
            assert parent.run.trajectory_id is not None
            body["branch"] = {"trajectory_id": parent.run.trajectory_id, "turn": parent.depth, "kind": "patr"}
        return body

    def advance(self, requests: Sequence[tuple[Node | None, int]]) -> list[NodeRun]:
        if self.client is not None:
            path = f"/admin/agents/{self.agent}/runs"
            return [self._answer(self.client.post(path, json=self.body(p, s), headers=self.headers)) for p, s in requests]
        return asyncio.run(self._advance(requests))

    @staticmethod
    def _answer(r: httpx.Response) -> NodeRun:
        if r.status_code != 200:
            return NodeRun(None, 0, True, error=f"{r.status_code}: {r.text[:300]}")
        return node_run(r.json())

    async def _advance(self, requests: Sequence[tuple[Node | None, int]]) -> list[NodeRun]:
        sem = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout_s) as client:

            async def one(parent: Node | None, sample_seed: int) -> NodeRun:
                async with sem:
                    try:
                        r = await client.post(f"/admin/agents/{self.agent}/runs", json=self.body(parent, sample_seed))
                    except httpx.HTTPError as exc:
                        return NodeRun(None, 0, True, error=f"{type(exc).__name__}: {exc}")
                return self._answer(r)

            runs = await asyncio.gather(*(one(p, s) for p, s in requests))
        failed = [r.error for r in runs if r.error]
        if failed:
            log.warning("patr segments failed", failed=len(failed), of=len(runs), first=failed[0])
        return list(runs)


class _Store(Protocol):
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...


def read_nodes(tree: Tree, store: _Store, wait_s: float = 30.0) -> dict[int, Trajectory]:
    """Each node's recorded segment (its sampled turns, meta ``rerollout = "patr"``), once the recorder has committed it."""
    out: dict[int, Trajectory] = {}
    deadline = time.monotonic() + wait_s
    pending = {nid: n for nid, n in tree.nodes.items()}
    while pending:
        for nid, n in list(pending.items()):
            assert n.run.trajectory_id is not None
            traj = store.get_trajectory(n.run.trajectory_id)
            if traj is not None and len(traj.turns) == n.run.turns and traj.meta.get("rerollout") == "patr":
                out[nid] = traj
                del pending[nid]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if pending:
        log.warning("patr segments not recorded in time", missing=len(pending))
    return out
