"""The served memory copilot: memory into an agent's system prompt before a run, a rewrite after it.

For an agent with ``memory`` in its config (``memory/config.py``), the host calls:

1. :meth:`Copilot.prepare` before the run: it resolves the scope from the caller (``runtime.identity``:
   the owner from the API key, the ``user`` field) and the session — ``user:<user>``, ``session:<id>``
   or ``agent:<name>`` — reads the owner's current memory and returns the messages with the memory as
   a leading system message (the loop merges it after the agent's own system prompt). No scope (e.g.
   ``scope: user`` without a ``user``) means no memory for that request: an anonymous memory would be
   shared by everyone.
2. :meth:`Copilot.after` once the run is done: it schedules the rewrite as a background task and
   returns at once, so the answer is never delayed by it. The task takes the scope's lock (rewrites of
   one document run one at a time, each on the latest version), asks the method for a prompt, calls the
   model through the ``RuntimeClient`` on the copilot's adapter family (its champion once published,
   else the base model), records that call as the copilot's own turn in its own trajectory (same
   session as the player, so deleting the session deletes it; meta ``agent: memopilot``, the scope,
   the method, the player's trajectory id and task key), and stores the new version with its
   provenance. Any failure is logged (``memory rewrite failed``) and the old memory stays; a document
   deleted while the rewrite ran is not brought back (``StaleMemory``). At most ``max_pending``
   rewrites wait at once; more are skipped with a warning.

**Learning from use.** The run given the memory is tagged with the document, the version it read and the copilot
trajectory whose rewrite wrote that version (``MemoryTicket.tag``); the runtime turns the rewards of the runs that
read a version into a reward on the rewrite that wrote it (``runtime/memory_credit.py``: the mean outcome, source
``memory:<the runs' source>``), so a learner job on the copilot's family (traffic ``agents: ["memopilot"]``) trains
the recorded rewrites with the ordinary sample path; ``docs/agents.md`` has the job.

With ``when: episode`` the transcripts of runs are buffered per document in this process (newest
6000 characters each, at most 10,000 documents; lost on restart) until a run ends an episode (it has a
verifier or environment reward); that run's rewrite sees them all.

Not here: the methods' prompts and parsing (``memory/methods.py``), storage (``memory/store.py``),
HTTP (``runtime/admin/memory.py``).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from learner.records import Turn, TurnTimings, new_id
from memory.config import MemoryConfig
from memory.methods import Interaction, MemoryMethod, get_method, keep_newest
from memory.store import MemoryQueries, Provenance, Snapshot, StaleMemory, scope_name
from runtime.agent_api import ANONYMOUS, MEMORY_REWRITE, MEMORY_SCOPE, MEMORY_VERSION, Lease, RuntimeClient, UnknownModel
from runtime.engine import SamplingParams
from runtime.identity import Caller, current_caller

log = structlog.get_logger(__name__)

COPILOT_AGENT = "memopilot"  # the ``agent`` of the copilot's trajectories (what the learner selects)
MEMORY_HEADER = "Memory from earlier interactions (notes to use):"
MAX_EPISODE_LOG_CHARS = 6000
MAX_EPISODE_BUFFERS = 10_000  # documents with an unfinished episode buffered at once


class CopilotError(RuntimeError):
    """The copilot's model call cannot be made (e.g. its prompt does not fit the context window)."""


class RunOutcome(Protocol):
    """What the copilot reads from a finished run (``agents.loop.RunResult`` has these)."""

    trajectory_id: str
    last_turn_id: str | None
    answer: str
    stop_reason: str
    reward: float | None
    correct: bool | None
    task_key: str | None

    @property
    def steps(self) -> Sequence[Any]: ...


@dataclass(frozen=True)
class MemoryTicket:
    """One run's memory: where it lives, what the run was given, and the snapshot the rewrite must respect."""

    owner: str
    scope: str
    session_id: str
    memory: str
    snapshot: Snapshot
    messages: list[dict[str, Any]]  # the run's messages with the memory system message in front
    rewrite: str | None = None  # the copilot trajectory whose rewrite wrote the version read (None: no model call wrote it)

    def tag(self) -> dict[str, Any]:
        """The trajectory meta of a run given this memory: the document, the version read and the rewrite that wrote it."""
        meta: dict[str, Any] = {MEMORY_SCOPE: self.scope, MEMORY_VERSION: self.snapshot.version}
        if self.rewrite is not None:
            meta[MEMORY_REWRITE] = self.rewrite
        return meta


def transcript_of(messages: Sequence[dict[str, Any]], result: RunOutcome) -> str:
    """The interaction as text: the conversation given to the run, each turn, tool results and observations, the answer."""
    lines = [f"{m['role'].capitalize()}: {m.get('content') or ''}" for m in messages if m.get("role") in ("user", "assistant")]
    for step in result.steps:
        lines.append(f"Assistant: {step.text}")
        for call in getattr(step, "tool_calls", ()) or ():
            lines.append(f"Tool {call.name}({call.arguments}) -> {call.content}")
        if getattr(step, "observation", None):
            lines.append(f"User: {step.observation}")
    lines.append(f"Final answer: {result.answer}")
    return "\n".join(lines)


def outcome_of(result: RunOutcome) -> str | None:
    if result.reward is None:
        return None
    text = f"reward {result.reward:g}"
    if result.correct is not None:
        text += " (correct)" if result.correct else " (not correct)"
    return text


def ends_episode(result: RunOutcome) -> bool:
    return result.reward is not None or result.stop_reason == "env_done"


class _KeyLock:
    """A per-document lock, dropped when no rewrite holds or waits for it."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class Copilot:
    """Memory for one agent; see the module docstring."""

    def __init__(self, config: MemoryConfig, store: MemoryQueries, client: RuntimeClient, agent: str, *, max_pending: int = 64) -> None:
        self.config = config
        self.store = store
        self.client = client
        self.agent = agent
        self.method: MemoryMethod = get_method(config.method, max_chars=config.max_chars)
        self.max_pending = max_pending
        self._tasks: set[asyncio.Task[None]] = set()
        self._locks: dict[tuple[str, str], _KeyLock] = {}
        self._episode_logs: dict[tuple[str, str], str] = {}

    def scope_for(self, caller: Caller, session_id: str) -> str | None:
        kind = self.config.scope
        if kind == "agent":
            return scope_name("agent", self.agent)
        if kind == "user":
            return scope_name("user", caller.user) if caller.user else None
        if session_id and session_id != ANONYMOUS:
            return scope_name("session", session_id)
        return None

    async def prepare(self, messages: list[dict[str, Any]], *, session_id: str) -> MemoryTicket | None:
        """Read the caller's memory and put it in front of ``messages``; None when this run has no memory."""
        if self.method.name == "none":
            return None
        caller = current_caller()
        try:
            scope = self.scope_for(caller, session_id)
        except ValueError as exc:  # a user or session id that cannot name a scope: no memory for this request
            log.warning("no memory for this request", agent=self.agent, reason=str(exc))
            return None
        if scope is None:
            return None
        try:
            memory, snapshot = await asyncio.to_thread(self.store.read, caller.owner, scope)
        except sqlite3.Error:  # the answer goes on without memory (and without a rewrite that could clobber it)
            log.exception("memory read failed; this run has no memory", agent=self.agent, scope=scope)
            return None
        out = list(messages)
        rewrite = None
        if memory.strip():
            out.insert(0, {"role": "system", "content": f"{MEMORY_HEADER}\n{memory}"})
            rewrite = await self._writer_of(caller.owner, scope, snapshot.version)
        return MemoryTicket(caller.owner, scope, session_id, memory, snapshot, out, rewrite)

    async def _writer_of(self, owner: str, scope: str, version: int) -> str | None:
        """The copilot trajectory that wrote ``version`` of the document (None: another version is current by now, or
        no model call wrote it); a failed read only loses the credit link."""
        try:
            current = await asyncio.to_thread(self.store.current, owner, scope)
        except Exception:  # the run goes on with its memory; only the credit link is lost
            log.exception("memory provenance read failed; this run's outcome will not credit the rewrite", agent=self.agent, scope=scope)
            return None
        if current is None or current.version != version:
            return None
        return current.provenance.copilot_trajectory_id

    def after(self, ticket: MemoryTicket, messages: Sequence[dict[str, Any]], result: RunOutcome) -> asyncio.Task[None] | None:
        """Schedule the rewrite for a finished run (returns at once); the task, or None when none is scheduled.

        A run whose prompt held the memory is tagged (in the background) with ``memory_scope``, as the copilot's own
        trajectories are (deleting the memory deletes them too, so no copy of it is left in the store), the version it
        read (``memory_version``) and the copilot trajectory that wrote it (``memory_rewrite``): the runtime credits that
        rewrite with the run's rewards (``runtime/memory_credit.py``)."""
        if ticket.memory.strip() and self.client.recording:
            tag = asyncio.create_task(self._tag(result.trajectory_id, ticket))
            self._tasks.add(tag)
            tag.add_done_callback(self._tasks.discard)
        interaction = Interaction(transcript_of(messages, result), outcome_of(result))
        key = (ticket.owner, ticket.scope)
        if self.config.when == "episode":
            buffered = self._episode_logs.pop(key, "")
            joined = f"{buffered}\n\n{interaction.transcript}".strip()
            if not ends_episode(result):
                self._episode_logs[key] = keep_newest(joined, MAX_EPISODE_LOG_CHARS)
                while len(self._episode_logs) > MAX_EPISODE_BUFFERS:  # the oldest unfinished episodes go first
                    dropped = next(iter(self._episode_logs))
                    del self._episode_logs[dropped]
                    log.warning("memory episode buffer dropped", agent=self.agent, scope=dropped[1])
                return None
            interaction = Interaction(joined, interaction.outcome)
        if len(self._tasks) >= self.max_pending:
            log.warning("memory rewrite skipped: too many pending", agent=self.agent, scope=ticket.scope, pending=len(self._tasks))
            return None
        task = asyncio.create_task(self._rewrite(ticket, interaction, result))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _tag(self, trajectory_id: str, ticket: MemoryTicket) -> None:
        try:
            await self.client.annotate(trajectory_id, ticket.tag())
        except Exception:  # an untagged run survives a later memory deletion: say so
            log.exception("could not tag a run as holding memory", agent=self.agent, scope=ticket.scope, trajectory=trajectory_id)

    async def drain(self) -> None:
        """Wait for every scheduled rewrite (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- the rewrite ---------------------------------------------------------------------------------
    async def _rewrite(self, ticket: MemoryTicket, interaction: Interaction, result: RunOutcome) -> None:
        key = (ticket.owner, ticket.scope)
        entry = self._locks.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                await self._rewrite_locked(ticket, interaction, result)
        except StaleMemory as exc:
            log.info("memory rewrite dropped", agent=self.agent, scope=ticket.scope, reason=str(exc))
        except Exception:  # the player already has its answer: log, keep the old memory
            log.exception(
                "memory rewrite failed", agent=self.agent, scope=ticket.scope, method=self.method.name, player_trajectory=result.trajectory_id
            )
        finally:
            entry.users -= 1
            if entry.users == 0:
                self._locks.pop(key, None)

    async def _rewrite_locked(self, ticket: MemoryTicket, interaction: Interaction, result: RunOutcome) -> None:
        memory, current = await asyncio.to_thread(self.store.read, ticket.owner, ticket.scope)
        base = Snapshot(current.version, ticket.snapshot.epoch)  # the latest version, but no deletion since the run began
        prompt = self.method.prompt(memory, interaction)
        adapter = copilot_traj = copilot_turn = None
        completion: str | None = None
        if prompt is not None:
            completion, adapter, copilot_traj, copilot_turn = await self._call(prompt, ticket, result)
        new = self.method.apply(memory, interaction, completion)
        if new == memory:
            log.info("memory unchanged", agent=self.agent, scope=ticket.scope, method=self.method.name, copilot_trajectory=copilot_traj)
            return
        meta = {"agent": self.agent, "task_key": result.task_key, "outcome": interaction.outcome}
        prov = Provenance(self.method.name, adapter, result.trajectory_id, result.last_turn_id, copilot_traj, copilot_turn, meta)
        saved = await asyncio.to_thread(self.store.write, ticket.owner, ticket.scope, new, prov, base=base)
        log.info("memory rewritten", agent=self.agent, scope=ticket.scope, version=saved.version, chars=len(new), adapter=adapter)

    def _lease(self, route_key: str) -> Lease:
        try:
            return self.client.acquire(self.config.adapter_family, route_key)
        except UnknownModel:
            return self.client.acquire(self.client.model_id, route_key)

    async def _call(self, prompt: list[dict[str, str]], ticket: MemoryTicket, result: RunOutcome) -> tuple[str, str | None, str, str]:
        """One copilot generation, recorded as its own trajectory; (text, adapter, trajectory id, turn id)."""
        client = self.client
        rid = f"memopilot-{uuid.uuid4().hex}"
        lease = self._lease(ticket.session_id if ticket.session_id != ANONYMOUS else rid)
        try:
            ids = client.render(list(prompt), None).token_ids
            room = client.max_model_len - len(ids)
            if room < 2:
                raise CopilotError(f"the copilot prompt ({len(ids)} tokens) leaves no room in the {client.max_model_len}-token context window")
            sampling = SamplingParams(max_new_tokens=min(self.config.max_tokens, room - 1), temperature=self.config.temperature, logprobs=True)
            t0 = time.time()
            res = await client.generate(ids, sampling, lease.adapter, rid)
        finally:
            client.release(lease)
        trajectory_id, turn_id = new_id("traj"), new_id("turn")
        turn = Turn(
            turn_id=turn_id,
            trajectory_id=trajectory_id,
            session_id=ticket.session_id,
            index=0,
            completion_id=rid,
            created_at=t0,
            model=COPILOT_AGENT,
            adapter=lease.adapter,
            context_ids=list(ids),
            output_ids=list(res.output_ids),
            logprobs=[lp.logprob for lp in res.logprobs],
            loss_mask=[1] * len(res.output_ids),
            sampling={"temperature": self.config.temperature, "top_p": 1.0, "agent": COPILOT_AGENT, "method": self.method.name},
            finish_reason=res.finish_reason,
            timings=TurnTimings(queued_s=res.timings.queued_s, ttft_s=res.timings.ttft_s, total_s=res.timings.total_s),
            messages=[dict(m) for m in prompt],
            output_text=res.text,
        )
        await client.record([turn])
        if client.recording:
            meta = {
                "agent": COPILOT_AGENT,
                MEMORY_SCOPE: ticket.scope,
                "memory_method": self.method.name,
                "player_agent": self.agent,
                "player_trajectory_id": result.trajectory_id,
                "task_key": result.task_key,
                "turns": 1,
                "trainable": True,
            }
            await client.annotate(trajectory_id, meta)
        return res.text, lease.adapter, trajectory_id, turn_id
