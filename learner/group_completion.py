"""Group completion for one-off chat turns: siblings from the exact recorded context, scored with the original.

    completer = GroupCompleter(client, store, cfg=singletons, family="chat-lora", samples_cfg=samples)
    report = asyncio.run(completer.complete(samples, model="chat-lora@3", seed=7))
    report.samples   # the completed groups' samples (original + G-1 siblings, each with the scorer's reward)

A live one-off conversation is a group of one: nothing to compare it with. For each rewarded trajectory whose
group is a singleton (newest first, at most ``max_turns_per_update``), the learner completes its **last rated turn**
(a one-turn chat's only turn; in a multi-turn chat the reply the user rated, or the last one when the rating is on
the whole conversation): it asks the runtime for ``G - 1`` siblings sampled from that turn's exact recorded
context ids with its recorded sampling (``POST /admin/turns/{turn_id}/siblings``, admin only; the runtime records
them as re-rollouts, outside the live sample stream), then scores the whole group of ``G`` answers with one scorer:

- a **reward hook**, the user's own reward code: ``module:function`` (called as ``fn(messages, completions)``,
  sync or async, returning one number per completion) or an ``http(s)`` URL (POSTed
  ``{"messages": [...], "completions": ["...", ...]}``, answering ``{"scores": [...]}``). It gets the group in
  order, the original first, and scores the original too, so the group is scored by one function and one
  source (``learner:hook:<name>``);
- an **LLM judge**: any model or adapter the runtime serves (``POST /admin/chat/completions``, not recorded),
  given the conversation once and all ``G`` answers, and asked for a score of each in one call (an integer
  0-10 per candidate under a JSON-schema grammar, so even a small judge answers in form; reward = score / 10),
  as ART's RULER does (relative scoring is easier than absolute, and GRPO only needs the order and
  spacing within a group; Corbitt 2025, "RULER: Easy Mode for RL Rewards"); source ``learner:judge:<model>``. LLM
  judges favour candidates by position (Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot
  Arena"; Wang et al. 2023, "Large Language Models are not Fair Evaluators"), so the judge sees the group in a
  shuffled order (:func:`judge_order`, seeded by the update's seed and the turn id: the same update shows the
  same order) and each score is mapped back to the member it was given for.

**The user's label is a veto, never a reward.** The group is trained on the scorer's numbers alone; the user's
reward on the original is only read as a label. Of the rewards on the original turn or its trajectory whose source
the learner trusts (``[samples] reward_sources``, which also ranks them) and is not an evaluator's
(``verifier:*``, ``judge:*``, ``hook:*``: the sources the runtime reserves for its evaluators and the learner's
scorers), the newest of the best-ranked source is the label: a thumbs-up above ``[singletons] label_threshold``
(default 0.5), a thumbs-down below it, and no label at it, so 0/1 and -1/+1 thumbs both work (a 1-5 star rating
sets 3). A fixed threshold rather than the traffic's running baseline: a label says what this user thought of this
answer, and must not turn into "average" because the rest of the traffic happened to be rated well (nor mean
nothing while a baseline warms up). When the scorer contradicts the label, ranking a thumbs-up original below the
group's mean or a thumbs-down one above it (exact arithmetic: ``G * s_original`` against the sum of the group's
scores), the group is skipped and counted (``contradicted``): its scores are not recorded, and the original stays
in the update with its own reward, where ``[singletons]`` gives it the running baseline like any one-off turn not
completed. The mean is the line because every estimator group completion runs with (GRPO, Dr.GRPO, RLOO, GiGPO,
turn-GRPO, on a group of one-turn trajectories) gives a member the sign of its score minus the group's mean, so a
thumbs-up answer is never trained down by its completed group and a thumbs-down one never up. A turn without a
user label (rated only by a verifier, or never) is never a contradiction.

The scores of a group that passes are recorded under the scorer's source through ``POST /admin/feedback`` (so the
console shows them and they outlive the update): on each sibling's trajectory, and on the original's trajectory when
it has one turn, else on its completed turn; then the group's samples are built from the store with that source
only, so a user's thumbs on the original and the scorer's numbers are never mixed in one group. The original's
score lies on a user's turn and belongs to that user; its ``learner:`` prefix keeps it out of every A/B
experiment's evidence (before it had one, the scores outranked the users' own ratings there and starved the
experiments of evidence).

**A multi-turn original's earlier turns stay out of the group.** Every member shares them (the siblings branch at the
completed turn), so the group's scores say nothing about them; they keep the user's rating and the running baseline
(``[singletons]``), as a one-off conversation that is not completed does (:func:`merge_completed`: they train as a
group of one whose score is the conversation's reward stream, exactly the score they had before).

A group whose scorer fails (an error, a wrong count, a non-finite number) is left out and counted (``failed``). The
report's ``version_mix`` counts the completed groups by which versions produced their members: the original's
recorded adapter (it may be several updates old) against the siblings' (the newest policy), ``base`` for the base
model.

Not here: the runtime side (``runtime/admin/replay.py``), advantages (the configured estimator), the running
baseline (``learner/baseline.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import httpx
import structlog

from learner.baseline import trajectory_score
from learner.config import SampleConfig, SingletonConfig
from learner.records import LEARNER_SOURCE_PREFIX, RESERVED_SOURCES, Trajectory, source_rank
from learner.samples import PART_SEP, Sample, SkipCounts, trajectory_samples

log = structlog.get_logger(__name__)

JUDGE_SYSTEM = (
    "You compare several candidate replies to the same conversation. Give each candidate a score from 0 (useless) to "
    "10 (perfect). Grading standard: {rubric} A reply that does what the user asked must score clearly higher than one "
    "that does not; if one candidate is only slightly better than another, keep their scores close. "
    'Answer only with JSON: {{"candidate_1": <score>, "candidate_2": <score>, ...}}, one entry per candidate.'
)
SCALE = 10  # the judge answers integers 0..SCALE (a grammar-constrained enum: a small judge cannot wander off), rewards are score / SCALE


def judge_schema(n: int) -> dict[str, Any]:
    """The judge's output format: exactly one integer score 0..10 per candidate, keys in candidate order."""
    score = {"type": "integer", "enum": list(range(SCALE + 1))}
    keys = [f"candidate_{i}" for i in range(1, n + 1)]
    return {"type": "object", "properties": dict.fromkeys(keys, score), "required": keys, "additionalProperties": False}


class ScorerError(RuntimeError):
    """A scorer did not give one finite score per completion."""


def source_name(prefix: str, name: str) -> str:
    """``learner:judge:<name>`` / ``learner:hook:<name>`` with the characters a reward source may hold
    (``runtime/admin/store.py``). ``learner:`` (:data:`learner.records.LEARNER_SOURCE_PREFIX`): the learner's scores
    of its own groups, recorded on users' turns too (the originals), are never A/B evidence."""
    return f"{LEARNER_SOURCE_PREFIX}{prefix}:{re.sub(r'[^A-Za-z0-9_.:-]', '_', name)[:180]}"


def load_hook(spec: str) -> Callable[..., Any]:
    """``module:function`` → the function (imported once); URLs are called over HTTP instead."""
    module, _, name = spec.partition(":")
    fn: Callable[..., Any] | None = getattr(importlib.import_module(module), name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward hook {spec!r}: {module} has no function {name!r}")
    return fn


def _scores(values: Any, n: int, who: str) -> list[float]:
    if not isinstance(values, list | tuple) or len(values) != n:
        raise ScorerError(f"{who} returned {values!r}: need a list of {n} numbers")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ScorerError(f"{who} returned {v!r}: need finite numbers")
        out.append(float(v))
    return out


def judge_messages(messages: Sequence[dict[str, Any]], completions: Sequence[str], rubric: str) -> list[dict[str, str]]:
    """The judge's prompt: the conversation once, then every candidate reply with its id (1-based)."""
    convo = json.dumps([{"role": m.get("role"), "content": m.get("content")} for m in messages], ensure_ascii=False)
    candidates = "\n\n".join(f'<candidate id="{i}">\n{text}\n</candidate>' for i, text in enumerate(completions, start=1))
    return [
        {"role": "system", "content": JUDGE_SYSTEM.format(rubric=rubric)},
        {"role": "user", "content": f"<conversation>\n{convo}\n</conversation>\n\n{candidates}"},
    ]


def parse_judge(text: str, n: int) -> list[float]:
    """Candidate i's reward from the judge's JSON: ``candidate_i`` / 10, clipped to [0, 1]; ScorerError when one is missing."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScorerError(f"the judge's answer is not JSON: {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise ScorerError(f"the judge's answer is not a JSON object: {text[:200]!r}")
    out: list[float] = []
    missing: list[int] = []
    for i in range(1, n + 1):
        v = data.get(f"candidate_{i}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            missing.append(i)
        else:
            out.append(min(1.0, max(0.0, float(v) / SCALE)))
    if missing:
        raise ScorerError(f"the judge scored no candidate {missing}: {text[:200]!r}")
    return out


def judge_order(n: int, key: str) -> list[int]:
    """The order the judge sees a group of ``n`` in: ``order[k]`` is the member shown as candidate ``k + 1``; a
    uniform permutation seeded by ``key`` (the same key, the same order)."""
    order = list(range(n))
    random.Random(key).shuffle(order)
    return order


@dataclass(frozen=True)
class Label:
    """A user's thumbs on an answer: ``sign`` +1 (up) or -1 (down), from ``value`` under ``source``."""

    sign: int
    value: float
    source: str


def user_label(traj: Trajectory, *, patterns: Sequence[str], threshold: float, turn_id: str | None = None) -> Label | None:
    """The user's label on the answer being completed (module docstring): the newest reward on that turn (``turn_id``,
    default the first) or on the trajectory from the best-ranked trusted source that is not an evaluator's; None without
    one or at ``threshold``."""
    first = turn_id if turn_id is not None else (traj.turns[0].turn_id if traj.turns else None)
    found: list[tuple[int, float, int, float, str]] = []  # (rank, -time, -stored position, value, source)
    for i, r in enumerate(traj.rewards):
        on_answer = (r.target == "turn" and r.target_id == first) or (r.target == "trajectory" and r.target_id == traj.trajectory_id)
        rank = source_rank(r.source, patterns)
        if on_answer and rank is not None and math.isfinite(r.value) and not r.source.lower().startswith(RESERVED_SOURCES):
            found.append((rank, -r.created_at, -i, r.value, r.source))
    if not found:
        return None
    _, _, _, value, source = min(found)
    if value == threshold:
        return None
    return Label(1 if value > threshold else -1, value, source)


def contradicts(label: Label | None, scores: Sequence[float], index: int = 0) -> bool:
    """Whether ``scores`` rank member ``index`` against its ``label``: a thumbs-up strictly below the group's mean, a
    thumbs-down strictly above it. Exact: ``G * s_index`` against ``sum(s)`` in rationals, so a member exactly at the
    mean (every score equal, say) is no contradiction."""
    if label is None:
        return False
    diff = Fraction(scores[index]) * len(scores) - sum((Fraction(s) for s in scores), Fraction(0))
    return diff * label.sign < 0


@dataclass
class CompletionReport:
    samples: list[Sample] = field(default_factory=list)  # the completed groups (original + siblings), scorer's rewards
    completed: list[str] = field(default_factory=list)  # trajectory ids of the originals whose group was completed
    siblings: int = 0  # siblings in the completed groups
    failed: int = 0  # groups left out (sibling request or scorer failed)
    contradicted: int = 0  # groups skipped: the scorer ranked the original against its user's label
    errors: list[str] = field(default_factory=list)
    contradictions: list[str] = field(default_factory=list)  # one line per contradicted group: the label, the score, the mean
    version_mix: dict[str, int] = field(default_factory=dict)  # completed groups per "original <adapter>, siblings <adapters>"

    def as_dict(self) -> dict[str, Any]:
        return {
            "completed_groups": len(self.completed),
            "siblings": self.siblings,
            "failed": self.failed,
            "contradicted": self.contradicted,
            "version_mix": dict(self.version_mix),
            "errors": self.errors[:5],
            "contradictions": self.contradictions[:5],
        }


@dataclass
class _Outcome:
    """One original's group: its samples (none when skipped), its version mix, and why it was skipped if it was."""

    samples: list[Sample]
    versions: str
    contradiction: str | None = None


class GroupCompleter:
    def __init__(self, client: httpx.AsyncClient, store: Any, *, cfg: SingletonConfig, family: str, samples_cfg: SampleConfig) -> None:
        self.client = client  # the runtime's admin API (base URL and admin key set)
        self.store = store
        self.cfg = cfg
        self.family = family
        self.samples_cfg = samples_cfg
        if cfg.scorer == "judge":
            assert cfg.judge_model is not None
            self.source = source_name("judge", cfg.judge_model)
            self._hook: Callable[..., Any] | None = None
        else:
            assert cfg.hook is not None
            url = cfg.hook.startswith(("http://", "https://"))
            self._hook = None if url else load_hook(cfg.hook)
            self.source = source_name("hook", re.sub(r"^https?://", "", cfg.hook) if url else cfg.hook)

    @staticmethod
    def candidates(samples: Sequence[Sample]) -> list[Sample]:
        """The turns group completion applies to: the last trained turn (the last rated one: the sample builder leaves out
        the turns after it) of each trajectory alone in its group, in the samples' order."""
        per_group: dict[str, set[str]] = {}
        last: dict[str, Sample] = {}
        for s in samples:
            per_group.setdefault(s.group_id, set()).add(s.trajectory_id)
            if s.trajectory_id not in last or s.turn_index > last[s.trajectory_id].turn_index:
                last[s.trajectory_id] = s
        return [s for s in samples if len(per_group[s.group_id]) == 1 and last[s.trajectory_id] is s]

    async def complete(self, candidates: Sequence[Sample], *, model: str, seed: int) -> CompletionReport:
        report = CompletionReport()
        chosen = sorted(candidates, key=lambda s: s.created_at, reverse=True)[: self.cfg.max_turns_per_update]
        results = await asyncio.gather(*(self._one(s, model=model, seed=seed * 1000 + i) for i, s in enumerate(chosen)), return_exceptions=True)
        for s, res in zip(chosen, results, strict=True):
            if isinstance(res, BaseException):
                report.failed += 1
                report.errors.append(f"{s.turn_id}: {res}")
                log.warning("group completion failed", turn_id=s.turn_id, error=str(res))
            elif res.contradiction is not None:
                report.contradicted += 1
                report.contradictions.append(f"{s.turn_id}: {res.contradiction}")
                log.info("group completion skipped: the scorer contradicts the user's label", turn_id=s.turn_id, why=res.contradiction)
            else:
                report.samples += res.samples
                report.completed.append(s.trajectory_id)
                report.siblings += len({x.trajectory_id for x in res.samples}) - 1
                report.version_mix[res.versions] = report.version_mix.get(res.versions, 0) + 1
        return report

    async def _one(self, original: Sample, *, model: str, seed: int) -> _Outcome:
        g = self.cfg.group_size
        body = {"n": g - 1, "model": model, "seed": seed}
        r = await self.client.post(f"/admin/turns/{original.turn_id}/siblings", json=body, timeout=self.cfg.timeout_s)
        if r.is_error:
            raise ScorerError(f"siblings: HTTP {r.status_code} {r.text[:200]}")
        sibling_ids = [d["trajectory_id"] for d in r.json()["data"]]
        orig = await asyncio.to_thread(self.store.get_trajectory, original.trajectory_id)
        sibs = [await asyncio.to_thread(self.store.get_trajectory, t) for t in sibling_ids]
        if orig is None or not orig.turns or any(t is None or not t.turns for t in sibs):
            raise ScorerError("the original or a sibling is not in the store")
        group: list[Trajectory] = [orig, *[t for t in sibs if t is not None]]
        turn = next((t for t in orig.turns if t.turn_id == original.turn_id), None)
        if turn is None:
            raise ScorerError(f"turn {original.turn_id} is not in its trajectory")
        messages = turn.messages
        texts = [turn.output_text or "", *[t.turns[0].output_text or "" for t in group[1:]]]
        # the judge sees the group shuffled (position bias); a hook, the user's own code, gets it in order
        order = judge_order(len(texts), f"{seed}:{original.turn_id}") if self.cfg.scorer == "judge" else list(range(len(texts)))
        shown = await self.score(messages, [texts[j] for j in order])
        scores = [0.0] * len(texts)
        for k, j in enumerate(order):
            scores[j] = shown[k]
        versions = f"original {turn.adapter or 'base'}, siblings " + "+".join(sorted({t.turns[0].adapter or "base" for t in group[1:]}))
        label = user_label(orig, patterns=self.samples_cfg.reward_sources, threshold=self.cfg.label_threshold, turn_id=turn.turn_id)
        if label is not None and contradicts(label, scores):
            thumbs = "thumbs-up" if label.sign > 0 else "thumbs-down"
            why = f"{thumbs} {label.value:g} ({label.source}) scored {scores[0]:g} by {self.source}, group mean {sum(scores) / len(scores):g}"
            return _Outcome([], versions, contradiction=why)
        for traj, score in zip(group, scores, strict=True):
            # a multi-turn original is scored on its completed turn: a trajectory reward would rate the turns before it too
            target = {"turn_id": turn.turn_id} if traj is orig and len(orig.turns) > 1 else {"trajectory_id": traj.trajectory_id}
            fb = await self.client.post("/admin/feedback", json={**target, "reward": score, "source": self.source}, timeout=self.cfg.timeout_s)
            if fb.is_error:
                raise ScorerError(f"recording the score: HTTP {fb.status_code} {fb.text[:200]}")
        only = self.samples_cfg.model_copy(update={"reward_sources": [self.source]})
        out: list[Sample] = []
        for tid in [t.trajectory_id for t in group]:
            traj = await asyncio.to_thread(self.store.get_trajectory, tid)
            assert traj is not None
            # siblings are fresh by construction; the original passed the live stream's staleness check already
            built = trajectory_samples(traj, family=self.family, min_version=0, cfg=only, counts=SkipCounts())
            out += [x for x in built if tid != orig.trajectory_id or x.turn_id == turn.turn_id]  # the original's completed turn only
        gid = original.group_id
        return _Outcome([s if s.group_id == gid else dataclasses.replace(s, group_id=gid) for s in out], versions)

    async def score(self, messages: Sequence[dict[str, Any]], completions: Sequence[str]) -> list[float]:
        """One score per completion, in the order given, from the configured scorer (``ScorerError`` when it gives anything else)."""
        n = len(completions)
        if self.cfg.scorer == "judge":
            body = {
                "model": self.cfg.judge_model,
                "messages": judge_messages(messages, completions, self.cfg.judge_rubric),
                "temperature": 0,
                "max_tokens": 12 * n + 16,
                "response_format": {"type": "json_schema", "json_schema": {"name": "scores", "schema": judge_schema(n)}},
            }
            r = await self.client.post("/admin/chat/completions", json=body, timeout=self.cfg.timeout_s)
            if r.is_error:
                raise ScorerError(f"judge: HTTP {r.status_code} {r.text[:200]}")
            return parse_judge(r.json()["choices"][0]["message"]["content"] or "", n)
        assert self.cfg.hook is not None
        if self._hook is None:
            async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as hc:
                r = await hc.post(self.cfg.hook, json={"messages": list(messages), "completions": list(completions)})
            if r.is_error:
                raise ScorerError(f"hook {self.cfg.hook}: HTTP {r.status_code} {r.text[:200]}")
            body = r.json()
            return _scores(body.get("scores") if isinstance(body, dict) else None, n, f"hook {self.cfg.hook}")
        if inspect.iscoroutinefunction(self._hook):
            values = await asyncio.wait_for(self._hook(list(messages), list(completions)), self.cfg.timeout_s)
        else:
            values = await asyncio.wait_for(asyncio.to_thread(self._hook, list(messages), list(completions)), self.cfg.timeout_s)
        return _scores(values, n, f"hook {self.cfg.hook}")


def merge_completed(samples: Sequence[Sample], report: CompletionReport) -> list[Sample]:
    """The update's samples with each completed original replaced by its group (``report.samples``).

    A multi-turn original's earlier turns (module docstring) stay, each such prefix a one-trajectory group of its own
    (trajectory ``<id>#before``, :func:`learner.samples.stored_trajectory_id`; group ``<group id>#before``) whose score
    is the conversation's reward stream as the live batch had it (its user's ratings, summed by
    :func:`learner.baseline.trajectory_score`), carried as the prefix's outcome under its source, so the running
    baseline treats it exactly as it treated the whole conversation (an estimator takes a trajectory in one group)."""
    done = set(report.completed)
    completed_turns = {s.turn_id for s in report.samples}
    by_traj: dict[str, list[Sample]] = {}
    for s in samples:
        if s.trajectory_id in done:
            by_traj.setdefault(s.trajectory_id, []).append(s)
    out = [s for s in samples if s.trajectory_id not in done]
    for members in by_traj.values():
        before = [s for s in members if s.turn_id not in completed_turns]
        if not before:
            continue
        first = members[0]
        part: dict[str, Any] = {"trajectory_id": f"{first.trajectory_id}{PART_SEP}before", "group_id": f"{first.group_id}{PART_SEP}before"}
        score = trajectory_score(members)
        if score is not None:  # the conversation's score, now the prefix's outcome
            source = first.trajectory_reward_source or next((s.reward_source for s in members if s.reward_source), None)
            part |= {"reward": None, "reward_source": None, "trajectory_reward": score, "trajectory_reward_source": source}
        out += [dataclasses.replace(s, **part) for s in before]
    return out + list(report.samples)
