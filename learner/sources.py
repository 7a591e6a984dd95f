"""The learner's own rollouts, per update: PATR trees (``rollouts = "patr"``) and the RODS task source (``[rods]``).

    sources = RolloutSources(settings, learner_dir, admin_url, admin_key, agent="fl", store=store, family="fl")
    rods_info = sources.before_collect(model, version)        # RODS without PATR: G runs per pool item (trained via the store)
    samples, adv, info = sources.trees(model, version)        # PATR: trees, their node samples and tree advantages

Which problems: with RODS on, ``items_per_update`` items sampled from the replay pool by boundary score
(``learner/rods.py``); else PATR's trees take problems ``patr_next .. + trees_per_update`` of ``[patr] seed``
(the index advances over updates; it rides in the trainer's cursor).

- **RODS alone**: each item gets ``group`` runs through ``POST /admin/agents/{agent}/runs`` (recorded as the
  agent's runs with the verifier's reward, so the update's sample collection takes them once they settle:
  keep ``[samples] settle_s`` small); their rewards give the item's boundary score.
- **PATR** (with or without RODS): each problem's tree is grown through the runs endpoint's segments
  (``learner/patr.py``); its nodes' recorded turns become samples in the group ``patr:<tree>`` with the tree
  advantage; with RODS on, the item's boundary score is read off the tree's independent runs (no extra
  inference): one leaf per root path, reached by following each forked node's first child
  (:func:`independent_leaf_rewards`). Leaves that share a forked prefix are not independent, and forks
  concentrate them under the prefixes the process scorer ranked highest, so all leaves would misstate the
  item's reward variance. ``[patr] roots`` is therefore the boundary score's sample size (at least 2).
- **Synthesis**: items whose boundary score reached ``tau`` in this update ask the runtime for ``variants``
  new problems of the same structure (``POST /admin/agents/{agent}/variants``, validated by the task's
  verifier there); the pool takes the new ones.

The pool is saved as ``rods_pool.json`` in the learner's folder after every update. Figures per update
(pool size, zero-variance fraction, boundary histogram, PATR's sampled tokens / tool calls / runs / forks /
stops) go into the update's history line and the learner's status (``GET /admin/learner``, ``/metrics``).

Not here: the tree algorithm (``learner/patr.py``), the pool (``learner/rods.py``), the optimizer step.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import zlib
from pathlib import Path
from typing import Any, Protocol

import httpx
import structlog

from learner.advantages import Advantages, AdvantageStats
from learner.config import LearnerSettings
from learner.patr import Budget, RuntimeStepper, Tree, grow_tree, read_nodes, tree_advantages
from learner.records import Trajectory
from learner.rods import ItemRef, ReplayPool
from learner.samples import Sample, parse_adapter, recorded_grammar

log = structlog.get_logger(__name__)

POOL_FILE = "rods_pool.json"
PATR_NEXT = "patr_next_problem"  # trainer.cursor key: the next problem index PATR grows a tree for (RODS off)
VARIANT_SEED_BASE = 1_000_000_000  # variant problem seeds: far above training, held-out and gate seeds


class _Store(Protocol):
    def get_trajectory(self, trajectory_id: str) -> Trajectory | None: ...


def variant_seed(item: ItemRef, round_: int) -> int:
    """The problem seed searched for variants of ``item`` in its ``round_``-th synthesis (new problems each time)."""
    return VARIANT_SEED_BASE + zlib.crc32(f"{item.key}:{round_}".encode()) % 1_000_000_000


def independent_leaf_rewards(tree: Tree) -> list[float]:
    """One reward per root path of ``tree``, in root order: the leaf reached from the root by always taking a node's
    first (successfully run) child. Children of a fork are i.i.d. policy continuations of one prefix, so taking the
    first, whatever the outcomes, gives each root one run distributed as an unforked rollout; roots are independent.
    A root whose first-child path ends without a leaf reward (its runs failed) contributes nothing."""
    out: list[float] = []
    for root in (n for n in tree.nodes.values() if n.parent is None):
        node = root
        while node.children:
            node = tree.nodes[node.children[0]]
        if node.id in tree.leaves and node.leaf_reward is not None and math.isfinite(node.leaf_reward):
            out.append(float(node.leaf_reward))
    return out


def tree_samples(tree: Tree, trajs: dict[int, Trajectory], adv: dict[int, float], *, family: str, group: str) -> tuple[list[Sample], list[float]]:
    """Each tree node's recorded turns as samples of group ``group``, with the node's advantage (one per turn: shared
    prefixes are stored once, so they are trained once). ``trajectory_reward`` is the mean leaf reward below the node."""
    samples: list[Sample] = []
    values: list[float] = []
    for nid, traj in sorted(trajs.items()):
        below = [tree.nodes[i].leaf_reward for i in tree.leaves_below(nid)]
        v = sum(r for r in below if r is not None) / len(below) if below else 0.0
        for turn in traj.turns:
            if not any(turn.loss_mask):
                continue
            _, version = parse_adapter(turn.adapter)
            samples.append(
                Sample.of_turn(
                    turn,
                    trajectory_id=traj.trajectory_id,
                    group_id=group,
                    version=version,
                    reward=None,
                    trajectory_reward=v,
                    meta=dict(traj.meta),
                    grammar=recorded_grammar(turn.sampling),
                    trajectory_reward_source="patr:tree",
                )
            )
            values.append(adv.get(nid, 0.0))
    return samples, values


class RolloutSources:
    """PATR trees and the RODS pool for one learner (module docstring)."""

    def __init__(
        self, settings: LearnerSettings, folder: Path, admin_url: str, admin_key: str | None, *, agent: str, store: _Store, family: str
    ) -> None:
        self.s, self.dir, self.url, self.key, self.agent, self.store, self.family = settings, Path(folder), admin_url, admin_key, agent, store, family
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.pool: ReplayPool | None = self._load_pool() if settings.rods.enabled else None
        self.last: dict[str, Any] = {}

    @property
    def patr(self) -> bool:
        return self.s.rollouts == "patr"

    def cursor_after(self, cursor: dict[str, Any]) -> dict[str, Any]:
        """The trainer-cursor keys this update moves: PATR's next problem index (RODS off)."""
        if self.patr and self.pool is None:
            return {PATR_NEXT: int(cursor.get(PATR_NEXT, 0)) + self.s.patr.trees_per_update}
        return {}

    # ---- the pool ----------------------------------------------------------------------------------
    def _load_pool(self) -> ReplayPool:
        r = self.s.rods
        path = self.dir / POOL_FILE
        if path.exists():
            try:
                return ReplayPool.from_dict(
                    json.loads(path.read_text()), patience=r.patience, floor=r.floor, exponent=r.exponent, capacity=r.capacity
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("unreadable RODS pool; starting from the seeds", error=str(exc))
        pool = ReplayPool(capacity=r.capacity, patience=r.patience, floor=r.floor, exponent=r.exponent, seed=0)
        pool.add_seeds(ItemRef(i, r.seed_problem_seed) for i in range(r.seeds))
        return pool

    def _save_pool(self) -> None:
        if self.pool is None:
            return
        tmp = self.dir / (POOL_FILE + ".tmp")
        tmp.write_text(json.dumps(self.pool.to_dict()))
        os.replace(tmp, self.dir / POOL_FILE)

    def _problems(self, cursor: dict[str, Any]) -> list[ItemRef]:
        if self.pool is not None:
            return self.pool.sample(self.s.rods.items_per_update)
        first = int(cursor.get(PATR_NEXT, 0))
        return [ItemRef(first + k, self.s.patr.seed) for k in range(self.s.patr.trees_per_update)]

    # ---- one update's rollouts ---------------------------------------------------------------------
    def round(self, model: str | None, version: int, cursor: dict[str, Any]) -> tuple[list[Sample], Advantages, dict[str, Any]]:
        """This update's own rollouts. With PATR: the trees' samples and their advantages; with RODS alone: the
        pool items' runs (recorded; the sample collection takes them), and no samples here. Also synthesis,
        the pool's save and this update's figures (``info``)."""
        items = self._problems(cursor)
        info: dict[str, Any] = {}
        samples: list[Sample] = []
        values: list[float] = []
        rewards: dict[str, list[float]] = {}
        if self.patr:
            budget = Budget()
            trees = []
            for k, item in enumerate(items):
                tree_id = f"{self.family}-v{version}-{k}-{random.Random(f'{version}:{k}:{item.key}').getrandbits(32):08x}"
                stepper = RuntimeStepper(
                    self.url, self.key, agent=self.agent, task=None, problem_index=item.problem_index, seed=item.seed, tree=tree_id,
                    model=model, advance_turns=self.s.patr.advance_turns, concurrency=self.s.rerollouts.concurrency,
                )  # fmt: skip
                tree = grow_tree(stepper, self.s.patr, random.Random(f"{self.s.trainer.seed}:{version}:{k}"))
                budget.add(tree.budget)
                trajs = read_nodes(tree, self.store)
                adv = tree_advantages(tree)
                ss, vv = tree_samples(tree, trajs, adv, family=self.family, group=f"patr:{tree_id}")
                samples += ss
                values += vv
                rewards[item.key] = independent_leaf_rewards(tree)  # not all leaves: forked siblings are correlated
                trees.append({"tree": tree_id, "problem": item.key, **tree.summary()})
            info["patr"] = {"trees": len(trees), **budget.as_dict(), "leaves": sum(t["leaves"] for t in trees), "per_tree": trees}
        elif self.pool is not None:
            runs = asyncio.run(self._group_runs(items, model, version))
            for item, rs in zip(items, runs, strict=True):
                rewards[item.key] = [float(r["reward"]) for r in rs if isinstance(r.get("reward"), int | float)]
            info["rods_runs"] = sum(len(rs) for rs in runs)
            info["trajectory_ids"] = [r["trajectory_id"] for rs in runs for r in rs if r.get("trajectory_id")]  # awaited by the service
            info["rods_sampled_tokens"] = sum(int(r.get("completion_tokens") or 0) for rs in runs for r in rs)
        if self.pool is not None:
            boundary = []
            for item in items:
                b = self.pool.observe(item, rewards.get(item.key, []))
                if b is not None and b >= self.s.rods.tau:
                    boundary.append(item)
            synth = self._synthesize(boundary) if self.s.rods.variants > 0 else {"asked": 0, "added": 0}
            info["rods"] = {**self.pool.end_update(), "boundary_items": len(boundary), "synthesis": synth}
            self._save_pool()
        self.last = info
        groups = {s.group_id for s in samples}
        zero = {g for g in groups if all(v == 0.0 for s, v in zip(samples, values, strict=True) if s.group_id == g)}
        stats = AdvantageStats(n_samples=len(samples), n_excluded=0, n_groups=len(groups), n_zero_std_groups=len(zero))
        return samples, Advantages(values, stats), info

    async def _group_runs(self, items: list[ItemRef], model: str | None, version: int) -> list[list[dict[str, Any]]]:
        sem = asyncio.Semaphore(self.s.rerollouts.concurrency)
        g = self.s.rods.group
        async with httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=900) as client:

            async def one(item: ItemRef, k: int) -> dict[str, Any]:
                body: dict[str, Any] = {"problem_index": item.problem_index, "seed": item.seed, "sample_seed": version * 100_003 + k}
                if model is not None:
                    body["model"] = model
                async with sem:
                    try:
                        r = await client.post(f"/admin/agents/{self.agent}/runs", json=body)
                    except httpx.HTTPError as exc:
                        log.warning("rods run failed", item=item.key, error=str(exc))
                        return {}
                if r.status_code != 200:
                    log.warning("rods run refused", item=item.key, status=r.status_code, body=r.text[:200])
                    return {}
                out: dict[str, Any] = r.json()
                return out

            flat = await asyncio.gather(*(one(it, k) for it in items for k in range(g)))
        return [list(flat[i * g : (i + 1) * g]) for i in range(len(items))]

    def _synthesize(self, boundary: list[ItemRef]) -> dict[str, Any]:
        assert self.pool is not None
        asked = added = rejected = 0
        for item in boundary:
            it = self.pool.items.get(item.key)
            body = {
                "problem_index": item.problem_index,
                "seed": item.seed,
                "k": self.s.rods.variants,
                "variant_seed": variant_seed(item, it.visits if it is not None else 0),
                "max_candidates": self.s.rods.max_candidates,
            }
            try:
                r = httpx.post(f"{self.url}/admin/agents/{self.agent}/variants", json=body, headers=self.headers, timeout=300)
            except httpx.HTTPError as exc:
                log.warning("rods synthesis failed", item=item.key, error=str(exc))
                continue
            if r.status_code != 200:
                log.warning("rods synthesis refused", item=item.key, status=r.status_code, body=r.text[:200])
                continue
            data = r.json()
            asked += 1
            rejected += sum(int(v) for v in data.get("rejected", {}).values())
            refs = [ItemRef(int(v["problem_index"]), int(v["seed"])) for v in data.get("data", [])]
            added += self.pool.add_variants(refs, parent=item)
        return {"asked": asked, "added": added, "rejected_candidates": rejected}


def join_tree_samples(
    live: list[Sample], live_adv: Advantages, own: tuple[list[Sample], Advantages, dict[str, Any]]
) -> tuple[list[Sample], Advantages]:
    """The live samples (their estimator's advantages) followed by PATR's tree samples (their tree advantages), for one step."""
    trees, tree_adv, _ = own
    ls, ts = live_adv.stats, tree_adv.stats
    stats = AdvantageStats(ls.n_samples + ts.n_samples, ls.n_excluded, ls.n_groups + ts.n_groups, ls.n_zero_std_groups + ts.n_zero_std_groups)
    return [*live, *trees], Advantages([*live_adv, *tree_adv], stats)
