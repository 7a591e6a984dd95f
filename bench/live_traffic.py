"""Live traffic against a real server: simulated users with their own API keys hold conversations about checkable tasks.

    .venv/bin/python bench/live_traffic.py --minutes 60 --users 8 --heldout-n 100           # the benchmark (make serve's defaults)
    .venv/bin/python bench/live_traffic.py --model tiny --minutes 1.5 --users 4 --heldout-n 16 --max-tokens 16 \
        --learner-job '{"family": "chat-lora", "gate_n": 0, "settings": {"traffic": {"chat": true, "agents": []}, "samples": {"settle_s": 10}}}'  # smoke
    .venv/bin/python bench/live_traffic.py --url http://127.0.0.1:8000 --admin-key KEY --api-key K1 --api-key K2 --minutes 10

What it runs: ``serve.py --model <model>`` with its default learners (the agent learner and the chat learner on family
``chat-lora``), one ``--api-key`` per simulated user and an admin key (``--spawn``, the default), or an existing
server (``--url``/``--admin-key``). Each user sends to ``chat-lora`` (the base model until the chat learner's first
version), one conversation at a time, each about a fresh reasoning-gym problem (``basic_arithmetic`` with small
numbers by default, where SmolLM2-135M is sometimes right), in one of these shapes (``--mix`` weights):

- ``focus`` (the default workload): chat completions, the problem, the reply, then "the final answer only", rated on
  the last reply (each request resends the whole conversation; the server stitches it into one trajectory);
- ``chat``: chat completions of 1-5 turns with follow-ups ("are you sure?", "explain", a correction, "final answer
  only"); some turns are regenerated (the same messages again), edited (an earlier user message changed), streamed,
  or ask ``n`` = 2-3 answers (the user continues with one of them);
- ``responses``: the Responses API, 1-5 turns chained by ``previous_response_id``; some turns regenerated or edited;
- ``agents``: openai-agents (its default Responses model class) with one ``function_tool``, a calculator whose
  argument is capped at 40 characters, that the agent must call (``tool_choice="required"``, stopping at the first
  tool: its answer is the calculator's result), 1-3 turns chained by ``previous_response_id``. openai-agents is
  imported as ``agents``, the name of loopwise's own package, so it runs in a worker process started outside the
  checkout (this file with ``--agents-worker``).

Most conversations rate one reply (often the last) through ``POST /v1/feedback`` by ``turn_id``, sometimes by
``trajectory_id`` or ``completion_id``, under the source ``"user"``, ``"thumbs"`` (+1/-1) or none (``feedback``);
some rate nothing; ``--garbage-users`` keys rate at random, each holding ``--garbage-rate`` conversations at a time. The users' answers are checked with the task's verifier
(the number in the last answer tags, boxed, "final answer" phrase or else the last number of the reply).

Meanwhile it polls ``GET /admin/learner`` and ``GET /admin/experiments``: learner restarts (the learner's pid changing,
and the status fields ``restarts``/``crashes``/``quarantined`` where the server has them), updates, every unused
sample's reason summed over updates (a trajectory still settling is counted by every update that defers it), and the
experiments decided with the rewards they could be decided on (users' ratings of a source they count, on their arms
while they ran, by user kind; their arms' ``n`` is read when they are first seen decided).
Then a fresh server (no learner, no users, nothing recorded) loads the chat family's champion by path and SHA-256 and
answers ``--heldout-n`` problems of another seed greedily in the two-turn focus shape, as does the base model: accuracy
of each on the final turn, and the paired difference with a 95% bootstrap CI. Results: ``--json-out`` (small JSON).

Importable for tests: :func:`make_users`, :func:`run_users` (-> :class:`TrafficReport`), :class:`LearnerWatch`,
:func:`heldout_two_turn`. What it does not do: no Anthropic Messages traffic, no tool calls by the chat users (the
agents users' calculator is the tool traffic), and it never reads the store directly (only the admin API).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import fnmatch
import json
import operator
import os
import random
import re
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
from pydantic import Field

ROOT = Path(__file__).resolve().parent.parent
FAMILY = "chat-lora"
SHAPES = ("focus", "chat", "responses", "agents")
DEFAULT_MIX = "focus=0.85,chat=0.05,responses=0.05,agents=0.05"
EXAMPLE = re.compile(r", for example <answer>[^<]*</answer>\.")  # the task prompt's format example (agents/tasks/rgym.py)
FINAL_ONLY = "Thanks. Now reply with the final answer only: just the number, in answer tags."  # no example number: SmolLM2 copies it
FOLLOW_UPS = {
    "sure": "Are you sure? Check it again and give the final answer in answer tags.",
    "explain": "Explain how you got that, then give the final answer in answer tags.",
    "correction": "I think that is wrong. Recompute it step by step and give the final answer in answer tags.",
    "final": FINAL_ONLY,
}
EDITED_PROBLEM = "Please solve this carefully.\n\n"
FORMS = {"turn_id": 0.7, "trajectory_id": 0.15, "completion_id": 0.15}  # how a user points at the reply it rates
SOURCES = {"": 0.6, "user": 0.2, "thumbs": 0.2}  # "": none named (the server's "feedback")
P_UNRATED, P_LAST = 0.1, 0.8  # a conversation rates nothing; a rating is on the last reply (else an earlier one)
P_REGENERATE, P_EDIT, P_N, P_STREAM = 0.15, 0.1, 0.15, 0.2
AGENT_MAX_TOKENS = 128  # the agent's forced calculator call is at most ~70 tokens (its argument is capped at 40 characters)


@dataclass(frozen=True)
class User:
    name: str
    key: str
    garbage: bool = False  # rates at random instead of checking the answer


@dataclass(frozen=True)
class Reply:
    """One answer a user saw, with the ids it can rate it by."""

    text: str
    turn_id: str | None
    trajectory_id: str | None
    completion_id: str | None
    choice_index: int | None = None  # set when the completion had n > 1 choices
    adapter: str | None = None  # the version that served it (None: the base model)


@dataclass(frozen=True)
class Rating:
    t: float
    user: str
    adapter: str  # "base" or family@N
    source: str  # as stored: "feedback" when the user named none
    form: str
    reward: float
    garbage: bool
    last: bool  # the conversation's last reply


@dataclass
class TrafficReport:
    """What the users did and saw. ``statuses`` counts every HTTP answer ("POST /v1/chat/completions 200")."""

    conversations: Counter[str] = field(default_factory=Counter)  # by shape
    aborted: Counter[str] = field(default_factory=Counter)  # conversations a failed request ended, by shape
    statuses: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # the first 50 failures, in words
    transport_errors: int = 0  # no HTTP answer at all (connection refused or reset, timeout)
    events: Counter[str] = field(default_factory=Counter)  # regenerate, edit, n>1, stream, tool calls, agent errors
    feedback: Counter[str] = field(default_factory=Counter)  # by form, by source, unrated
    ratings: list[Rating] = field(default_factory=list)
    final_turn: dict[str, list[bool]] = field(default_factory=dict)  # focus shape: the final reply correct, by serving version
    trajectories: dict[str, set[str]] = field(default_factory=dict)  # user name -> trajectory ids it was given
    wall_s: float = 0.0

    def error(self, what: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(what)

    def server_errors(self) -> int:
        return sum(n for k, n in self.statuses.items() if k.rsplit(" ", 1)[-1].startswith("5"))

    def requests(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> dict[str, Any]:
        final = {a: {"n": len(v), "correct": round(sum(v) / len(v), 3)} for a, v in sorted(self.final_turn.items())}
        return {
            "wall_s": round(self.wall_s, 1),
            "conversations": dict(self.conversations),
            "aborted": dict(self.aborted),
            "requests": self.requests(),
            "server_errors": self.server_errors(),
            "transport_errors": self.transport_errors,
            "statuses": dict(sorted(self.statuses.items())),
            "errors": self.errors[:10],
            "events": dict(self.events),
            "feedback": dict(self.feedback),
            "ratings": len(self.ratings),
            "final_turn_live": final,
        }


def make_users(n: int, garbage: int = 1, seed: int = 0) -> list[User]:
    """``n`` users with fresh API keys; the last ``garbage`` of them (never all, unless n == garbage) rate at random."""
    rng = random.Random(seed)
    return [User(f"user{i}", f"lt{i}-{rng.getrandbits(64):016x}{secrets.token_hex(4)}", garbage=i >= n - garbage) for i in range(n)]


def parse_mix(text: str) -> dict[str, float]:
    """``"focus=0.8,chat=0.1"`` -> weights by shape (shapes not named get 0)."""
    mix = dict.fromkeys(SHAPES, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        if name.strip() not in mix:
            raise ValueError(f"unknown shape {name!r} in --mix (shapes: {', '.join(SHAPES)})")
        mix[name.strip()] = float(weight or 1)
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError("--mix weights must be >= 0 and not all 0")
    return mix


def _pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _status_hook(sink: Counter[str]) -> Callable[[Any], Any]:
    async def hook(response: Any) -> None:
        sink[f"{response.request.method} {response.request.url.path} {response.status_code}"] += 1

    return hook


# ---- the users ------------------------------------------------------------------------------------------------


class _Traffic:
    """The shared state of one run: the task, the next unseen problem, the report, the agents worker."""

    def __init__(self, base_url: str, task: Any, problems: list[Any], model: str, max_tokens: int, report: TrafficReport) -> None:
        self.base_url, self.task, self.problems, self.model, self.max_tokens = base_url.rstrip("/"), task, problems, model, max_tokens
        self.report = report
        self.next = 0
        self.worker: AgentsWorker | None = None

    def problem(self) -> Any:
        p = self.problems[self.next % len(self.problems)]
        self.next += 1
        return p

    def correct(self, problem: Any, text: str) -> bool:
        return bool(self.task.verify(problem, text).correct)

    def client(self, user: User) -> openai.AsyncOpenAI:
        http = openai.DefaultAsyncHttpxClient(timeout=900, event_hooks={"response": [_status_hook(self.report.statuses)]})
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=user.key, max_retries=0, http_client=http)

    async def user(self, user: User, seed: int, mix: dict[str, float], quota: int | None, deadline: float | None, lane: int = 0) -> None:
        rng = random.Random(f"{seed}:{user.name}" if lane == 0 else f"{seed}:{user.name}:{lane}")
        oai = self.client(user)
        done = 0
        try:
            while (quota is None or done < quota) and (deadline is None or time.monotonic() < deadline):
                shape = _pick(rng, mix)
                session = f"{user.name}-{lane}-{done}-{rng.getrandbits(32):08x}"
                self.report.conversations[shape] += 1
                replies = await getattr(self, "_" + shape)(oai, user, rng, session)
                done += 1
                if replies is None:
                    self.report.aborted[shape] += 1
                    await asyncio.sleep(0.5)
        finally:
            await oai.close()

    def _seen(self, user: User, replies: list[Reply]) -> None:
        self.report.trajectories.setdefault(user.name, set()).update(r.trajectory_id for r in replies if r.trajectory_id)

    def _failed(self, what: str, exc: Exception) -> None:
        if isinstance(exc, openai.APIStatusError):
            self.report.error(f"{what}: {exc.status_code} {str(exc.message)[:200]}")
            return
        if isinstance(exc, openai.APIConnectionError):  # no HTTP answer (refused, reset, timed out): the hook counted nothing
            self.report.transport_errors += 1
        self.report.error(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")  # else an answer the client could not read

    # -- one request of each API

    async def _chat_call(
        self, oai: openai.AsyncOpenAI, user: User, messages: list[dict[str, str]], session: str, n: int = 1, stream: bool = False
    ) -> list[Reply] | None:
        kw: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "extra_headers": {"X-Session-Id": session}}
        try:
            if stream:
                self.report.events["stream"] += 1
                pieces: list[str] = []
                ids: dict[str, Any] = {}
                cid = None
                async for chunk in await oai.chat.completions.create(stream=True, **kw):
                    cid = chunk.id
                    pieces += [c.delta.content or "" for c in chunk.choices]
                    ids = (chunk.model_extra or {}).get("loopwise") or ids
                if not ids:
                    self.report.error("chat stream: no loopwise ids on any chunk")
                out = [Reply("".join(pieces), ids.get("turn_id"), ids.get("trajectory_id"), cid, None, ids.get("adapter"))]
            else:
                if n > 1:
                    self.report.events["n>1"] += 1
                r = await oai.chat.completions.create(n=n, **kw)
                lw = (r.model_extra or {}).get("loopwise") or {}
                per = lw.get("choices") or [lw]
                out = [
                    Reply(c.message.content or "", i.get("turn_id"), i.get("trajectory_id"), r.id, c.index if n > 1 else None, lw.get("adapter"))
                    for c, i in zip(r.choices, per, strict=True)
                ]
        except (openai.APIError, ValueError) as exc:
            self._failed("chat", exc)
            return None
        self._seen(user, out)
        return out

    async def _responses_call(self, oai: openai.AsyncOpenAI, user: User, text: str, previous: str | None, session: str) -> tuple[str, Reply] | None:
        try:
            r = await oai.responses.create(
                model=self.model,
                input=text,
                previous_response_id=previous,
                max_output_tokens=self.max_tokens,
                extra_headers={"X-Session-Id": session},
            )
        except openai.APIError as exc:
            self._failed("responses", exc)
            return None
        lw = (r.model_extra or {}).get("loopwise") or {}
        reply = Reply(r.output_text, lw.get("turn_id"), lw.get("trajectory_id"), r.id, None, lw.get("adapter"))
        self._seen(user, [reply])
        return r.id, reply

    # -- the shapes: each returns the replies the user saw (None: a request failed and the user gave up)

    async def _focus(self, oai: openai.AsyncOpenAI, user: User, rng: random.Random, session: str) -> list[Reply] | None:
        problem = self.problem()
        messages = [{"role": "user", "content": ask(problem)}]
        first = await self._chat_call(oai, user, messages, session)
        if first is None:
            return None
        messages += [{"role": "assistant", "content": first[0].text}, {"role": "user", "content": FINAL_ONLY}]
        final = await self._chat_call(oai, user, messages, session)
        if final is None:
            return None
        self.report.final_turn.setdefault(final[0].adapter or "base", []).append(self.correct(problem, final[0].text))
        replies = first + final
        await self._rate(oai, user, rng, problem, replies, last_only=True)
        return replies

    async def _chat(self, oai: openai.AsyncOpenAI, user: User, rng: random.Random, session: str) -> list[Reply] | None:
        problem = self.problem()
        messages: list[dict[str, str]] = []
        replies: list[Reply] = []
        for t in range(rng.randint(1, 5)):
            messages.append({"role": "user", "content": ask(problem) if t == 0 else FOLLOW_UPS[rng.choice(list(FOLLOW_UPS))]})
            n = rng.choice((2, 3)) if rng.random() < P_N else 1
            got = await self._chat_call(oai, user, messages, session, n=n, stream=n == 1 and rng.random() < P_STREAM)
            if got is None:
                return None
            replies += got
            again: list[Reply] | None = got
            if rng.random() < P_REGENERATE:  # the same messages again: a new trajectory, branched from the same turn
                self.report.events["regenerate"] += 1
                again = await self._chat_call(oai, user, messages, session)
            elif t > 0 and rng.random() < P_EDIT:  # an earlier user message changed, the conversation cut there
                self.report.events["edit"] += 1
                i = rng.choice([i for i, m in enumerate(messages) if m["role"] == "user"])
                text = EDITED_PROBLEM + ask(problem) if i == 0 else FOLLOW_UPS[rng.choice(list(FOLLOW_UPS))]
                messages = [*messages[:i], {"role": "user", "content": text}]
                again = await self._chat_call(oai, user, messages, session)
            if again is None:
                return None
            if again is not got:
                replies += again
            messages.append({"role": "assistant", "content": rng.choice(again).text})  # with n > 1 the user goes on with one answer
        await self._rate(oai, user, rng, problem, replies)
        return replies

    async def _responses(self, oai: openai.AsyncOpenAI, user: User, rng: random.Random, session: str) -> list[Reply] | None:
        problem = self.problem()
        previous: str | None = None
        replies: list[Reply] = []
        for t in range(rng.randint(1, 5)):
            text = ask(problem) if t == 0 else FOLLOW_UPS[rng.choice(list(FOLLOW_UPS))]
            got = await self._responses_call(oai, user, text, previous, session)
            if got is None:
                return None
            replies.append(got[1])
            if rng.random() < P_REGENERATE or (t > 0 and rng.random() < P_EDIT):  # again from the same previous response
                edit = rng.random() < 0.5
                self.report.events["edit" if edit else "regenerate"] += 1
                again = FOLLOW_UPS[rng.choice(list(FOLLOW_UPS))] if edit and t > 0 else (EDITED_PROBLEM + text if edit else text)
                got = await self._responses_call(oai, user, again, previous, session)
                if got is None:
                    return None
                replies.append(got[1])
            previous = got[0]
        await self._rate(oai, user, rng, problem, replies)
        return replies

    async def _agents(self, oai: openai.AsyncOpenAI, user: User, rng: random.Random, session: str) -> list[Reply] | None:
        if self.worker is None:
            self.worker = AgentsWorker()
            await self.worker.start()
        problem = self.problem()
        turns = [ask(problem)] + [FOLLOW_UPS[rng.choice(list(FOLLOW_UPS))] for _ in range(rng.randint(0, 2))]
        job = {
            "base_url": self.base_url + "/v1",
            "key": user.key,
            "model": self.model,
            "session": session,
            "turns": turns,
            "max_tokens": max(self.max_tokens, AGENT_MAX_TOKENS),
        }
        out = await self.worker.run(job)
        self.report.statuses.update(out.get("statuses", {}))
        self.report.transport_errors += int(out.get("transport_errors", 0))
        self.report.events["tool_calls"] += int(out.get("tool_calls", 0))
        if out.get("uncalled"):
            self.report.events["forced_tool_call_as_text"] += int(out["uncalled"])
        replies = []
        for t in out.get("turns", []):
            lw = t.get("loopwise") or {}
            replies.append(Reply(t["text"], lw.get("turn_id"), lw.get("trajectory_id"), t.get("response_id"), None, lw.get("adapter")))
        self._seen(user, replies)
        if out.get("error"):
            self.report.events[f"agents:{out['error'].split(':')[0]}"] += 1
            if out.get("http_error"):
                self.report.error(f"agents: {out['error'][:200]}")
            if not replies:
                return None
        await self._rate(oai, user, rng, problem, replies)
        return replies

    # -- feedback

    async def _rate(
        self, oai: openai.AsyncOpenAI, user: User, rng: random.Random, problem: Any, replies: list[Reply], last_only: bool = False
    ) -> None:
        if not replies or rng.random() < P_UNRATED:
            self.report.feedback["unrated"] += 1
            return
        target = replies[-1] if last_only or len(replies) == 1 or rng.random() < P_LAST else rng.choice(replies[:-1])
        form, source = _pick(rng, FORMS), _pick(rng, SOURCES)
        good = rng.random() < 0.5 if user.garbage else self.correct(problem, target.text)
        reward = (1.0 if good else -1.0) if source == "thumbs" else float(good)
        ident = getattr(target, form)
        if ident is None:  # e.g. an agents turn whose ids the worker did not see: rate the completion instead
            form, ident = "completion_id", target.completion_id
        body: dict[str, Any] = {form: ident, "reward": reward}
        if form == "completion_id" and target.choice_index is not None:
            body["choice_index"] = target.choice_index
        if source:
            body["source"] = source
        if rng.random() < 0.2:
            body["idempotency_key"] = f"{user.name}-{rng.getrandbits(48):012x}"
        try:
            await oai.post("/feedback", body=body, cast_to=object)
        except openai.APIError as exc:
            self._failed(f"feedback by {form}", exc)
            return
        self.report.feedback[form] += 1
        self.report.feedback[f"source:{source or 'none'}"] += 1
        last = target is replies[-1]
        self.report.ratings.append(Rating(time.time(), user.name, target.adapter or "base", source or "feedback", form, reward, user.garbage, last))


async def run_users(
    base_url: str,
    users: list[User],
    *,
    task: Any,
    problems: list[Any],
    minutes: float | None = None,
    conversations: int | None = None,
    mix: dict[str, float] | str = DEFAULT_MIX,
    seed: int = 0,
    max_tokens: int = 64,
    model: str = FAMILY,
    garbage_rate: int = 1,
) -> TrafficReport:
    """The users' traffic against ``base_url`` (the server root), each user one conversation at a time, until
    ``minutes`` have passed or ``conversations`` (split evenly over the users) are done. A garbage user holds
    ``garbage_rate`` conversations at a time (its key rates that many times as often as an honest one)."""
    if minutes is None and conversations is None:
        raise ValueError("give minutes or conversations")
    weights = parse_mix(mix) if isinstance(mix, str) else mix
    report = TrafficReport()
    traffic = _Traffic(base_url, task, problems, model, max_tokens, report)
    deadline = time.monotonic() + 60 * minutes if minutes is not None else None
    quotas = (
        [conversations // len(users) + (i < conversations % len(users)) for i in range(len(users))]
        if conversations is not None
        else [None] * len(users)
    )
    t0 = time.monotonic()
    try:
        loops = [
            traffic.user(u, seed, weights, q, deadline, lane=j)
            for u, q in zip(users, quotas, strict=True)
            for j in range(garbage_rate if u.garbage else 1)
        ]
        await asyncio.gather(*loops)
    finally:
        if traffic.worker is not None:
            await traffic.worker.close()
        report.wall_s = time.monotonic() - t0
    return report


# ---- the openai-agents users, in a worker process ----------------------------------------------------------------


class AgentsWorker:
    """This file run with ``--agents-worker`` outside the checkout (openai-agents' ``agents`` would otherwise be
    loopwise's): jobs in as JSON lines on stdin, results out as JSON lines on stdout, many jobs at once."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = 0
        self.tmp = tempfile.TemporaryDirectory(prefix="live-traffic-agents-")
        self.reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.log = open(Path(self.tmp.name) / "worker.log", "w+")  # closed in close()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--agents-worker",
            cwd=self.tmp.name, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self.log, limit=1 << 24,
        )  # fmt: skip
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            out = json.loads(line)
            fut = self.pending.pop(out["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(out)
        self.log.flush()
        self.log.seek(0)
        why = f"the agents worker exited ({await self.proc.wait()}): {self.log.read()[-2000:]}"
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result({"error": why, "http_error": True})

    async def run(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.ids += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[self.ids] = fut
        self.proc.stdin.write((json.dumps({**job, "id": self.ids}) + "\n").encode())
        await self.proc.stdin.drain()
        return await fut

    async def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
        if self.reader is not None:
            await self.reader
        self.log.close()
        self.tmp.cleanup()


_OPS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: Annotated[str, Field(max_length=40)]) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and brackets (no names, no calls), e.g. "(3 + 4) * 2"."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        raise ValueError("only numbers, + - * / and brackets")

    try:
        if len(expression) > 200:
            raise ValueError("expression too long")
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def agents_worker() -> int:
    """The worker's side: one asyncio loop running every job of stdin concurrently (openai-agents imported here)."""
    # openai-agents' ``agents`` (this process runs outside the checkout); a type checker run from the checkout sees loopwise's
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled  # type: ignore[attr-defined]

    set_tracing_disabled(True)
    tool = function_tool(calculate)

    async def job(j: dict[str, Any]) -> dict[str, Any]:
        statuses: Counter[str] = Counter()
        seen: list[dict[str, Any]] = []  # the loopwise ids of every Responses call, in order

        async def hook(response: Any) -> None:
            statuses[f"{response.request.method} {response.request.url.path} {response.status_code}"] += 1
            if response.headers.get("content-type", "").startswith("application/json"):
                await response.aread()
                try:
                    body = response.json()
                except ValueError:
                    return
                if isinstance(body, dict) and body.get("loopwise"):
                    seen.append(body["loopwise"])

        http = openai.DefaultAsyncHttpxClient(timeout=900, event_hooks={"response": [hook]})
        client = openai.AsyncOpenAI(base_url=j["base_url"], api_key=j["key"], max_retries=0, http_client=http)
        settings = ModelSettings(tool_choice="required", max_tokens=j["max_tokens"], extra_headers={"X-Session-Id": j["session"]})
        agent = Agent(
            name="math-helper",
            instructions="Call the calculate tool with the arithmetic expression the user asks about; its result is your answer.",
            model=OpenAIResponsesModel(j["model"], client),
            tools=[tool],
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        turns: list[dict[str, Any]] = []
        out: dict[str, Any] = {"id": j["id"], "turns": turns, "tool_calls": 0}
        previous = None
        try:
            for text in j["turns"]:
                n0 = len(seen)
                result = await Runner.run(agent, text, previous_response_id=previous, max_turns=4)
                previous = result.last_response_id
                calls = sum(1 for item in result.new_items if item.type == "tool_call_item")
                out["tool_calls"] += calls
                out["uncalled"] = out.get("uncalled", 0) + (calls == 0)  # tool_choice "required", yet the reply was text
                turns.append({"text": str(result.final_output or ""), "response_id": previous, "loopwise": seen[-1] if len(seen) > n0 else None})
        except openai.APIStatusError as exc:
            out["error"], out["http_error"] = f"APIStatusError: {exc.status_code} {str(exc.message)[:200]}", True
        except openai.APIError as exc:
            out["error"], out["http_error"] = f"{type(exc).__name__}: {exc}", True
            out["transport_errors"] = int(isinstance(exc, openai.APIConnectionError))
        except Exception as exc:  # the framework's own verdicts on the model (MaxTurnsExceeded, ModelBehaviorError): the user gives up
            out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            await client.close()
        out["statuses"] = dict(statuses)
        return out

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()

        async def one(line: bytes) -> None:
            j = json.loads(line)
            try:
                out = await job(j)
            except Exception as exc:  # a bug of this worker: reported as the job's error, the worker goes on
                out = {"id": j["id"], "turns": [], "error": f"worker: {type(exc).__name__}: {exc}", "http_error": True}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()

        while line := await reader.readline():
            t = asyncio.create_task(one(line))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    asyncio.run(main())
    return 0


# ---- the learner, watched through the admin API ------------------------------------------------------------------


@dataclass
class LearnerWatch:
    """What polling ``GET /admin/learner`` and ``GET /admin/experiments`` saw, per learner family."""

    base_url: str
    admin_key: str
    pids: dict[str, list[int]] = field(default_factory=dict)  # every pid each family's status named, in order
    states: dict[str, Counter[str]] = field(default_factory=dict)
    peak: dict[str, Counter[str]] = field(default_factory=dict)  # the largest restarts / crashes / quarantined seen
    last: dict[str, dict[str, Any]] = field(default_factory=dict)
    experiments: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> GET /admin/experiments/{name}
    poll_errors: list[str] = field(default_factory=list)
    polls: int = 0

    def _get(self, client: httpx.Client, path: str) -> Any:
        r = client.get(self.base_url.rstrip("/") + path, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60)
        r.raise_for_status()
        return r.json()

    def poll(self) -> None:
        """One look at the learners and the experiments (blocking; run it off the event loop)."""
        self.polls += 1
        with httpx.Client() as client:
            try:
                for s in self._get(client, "/admin/learner?history=0")["data"]:
                    fam = s["family"]
                    pids = self.pids.setdefault(fam, [])
                    if s.get("pid") is not None and (not pids or pids[-1] != s["pid"]):
                        pids.append(s["pid"])
                    self.states.setdefault(fam, Counter())[str(s.get("state"))] += 1
                    if s.get("running") is False and s.get("state") != "starting":  # status.json not refreshed: the process is gone
                        self.states[fam]["not running"] += 1
                    peak = self.peak.setdefault(fam, Counter())
                    for k in ("restarts", "crashes", "quarantined"):
                        v = s.get(k)
                        n = len(v) if isinstance(v, list | dict) else int(v or 0)
                        peak[k] = max(peak[k], n)
                    self.last[fam] = s
                for e in self._get(client, "/admin/experiments")["data"]:
                    known = self.experiments.get(e["name"])
                    if known is None or known.get("status") == "running":
                        self.experiments[e["name"]] = self._get(client, f"/admin/experiments/{e['name']}")
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                self.poll_errors.append(f"{type(exc).__name__}: {exc}"[:300])

    def history(self, family: str) -> list[dict[str, Any]]:
        with httpx.Client() as client:
            for s in self._get(client, "/admin/learner?history=1000")["data"]:
                if s["family"] == family:
                    return list(s.get("history", []))
        return []

    def report(self, family: str, ratings: list[Rating]) -> dict[str, Any]:
        """The family's learner over the run: restarts, updates, unused samples by reason (summed over updates), gates,
        and its experiments with the rewards users gave their arms while each ran (``ratings``: the users' log)."""
        history = self.history(family)
        unused: Counter[str] = Counter()
        for rec in history:
            unused.update((rec.get("unused") or {}).get("counts") or {})
        trained = [int((rec.get("unused") or {}).get("trained", 0)) for rec in history]
        s = self.last.get(family, {})
        pids = self.pids.get(family, [])
        peak = self.peak.get(family, Counter())
        return {
            "state": s.get("state"),
            "detail": str(s.get("detail", ""))[:300],
            "version": s.get("version"),
            "champion": s.get("champion"),
            "updates": s.get("updates", len(history)),
            "updates_trained": sum(1 for n in trained if n > 0),
            "samples_trained": sum(trained),
            "process_restarts": max(0, len(pids) - 1),
            "status_restarts": peak["restarts"],  # the status field: restarts from the champion after a rejected version, today
            "crashes": peak["crashes"],
            "quarantined": peak["quarantined"],
            "error_polls": self.states.get(family, Counter())["error"],
            "down_polls": self.states.get(family, Counter())["not running"],
            "unused": dict(unused.most_common()),
            "gates": dict(Counter(str((rec.get("gate") or {}).get("decision")) for rec in history)),
            "experiments": [
                experiment_summary(e, ratings) for e in self.experiments.values() if e.get("family") == family or _family_of(e) == family
            ],
        }


def _family_of(exp: dict[str, Any]) -> str | None:
    return (exp.get("config") or {}).get("family")


def evidence_rank(exp_config: dict[str, Any], source: str) -> int | None:
    """Where a user's reward of ``source`` ranks for an experiment with this config (0 = counts; None = never counts): its
    ``metric`` exactly, else its learner's ``reward_sources`` patterns (best first: only the best rank present on any arm
    counts), else ``sources`` ("trusted" = the runtime's own verifier:* / judge:* only, which users cannot send)."""
    if exp_config.get("metric") is not None:
        return 0 if source == exp_config["metric"] else None
    if exp_config.get("reward_sources"):
        return next((i for i, p in enumerate(exp_config["reward_sources"]) if fnmatch.fnmatchcase(source, p)), None)
    return 0 if exp_config.get("sources") == "any" else None


def experiment_summary(exp: dict[str, Any], ratings: list[Rating]) -> dict[str, Any]:
    """An experiment's outcome and, from the users' own log, whose rewards could be its evidence: ratings of a source it
    counts, on replies its arms served while it ran, by user kind and source (the server's own count is the arms' ``n``)."""
    cfg = exp.get("config") or {}
    arms = [a["adapter"] for a in exp.get("arms", [])]
    start = float(exp.get("started_at") or 0)
    decisions = exp.get("decisions") or []
    end = max((float(d.get("time", 0)) for d in decisions), default=time.time()) if exp.get("status") != "running" else time.time()
    ranked = [(r, evidence_rank(cfg, r.source)) for r in ratings if r.adapter in arms and start <= r.t <= end]
    best = min((k for _, k in ranked if k is not None), default=None)
    on = [r for r, k in ranked if k is not None and k == best]
    return {
        "name": exp.get("name"),
        "status": exp.get("status"),
        "winner": exp.get("winner"),
        "evidence": {k: cfg.get(k) for k in ("metric", "reward_sources", "sources", "owners") if cfg.get(k) is not None},
        "arms": [{"adapter": a.get("adapter"), "n": a.get("n"), "mean_reward": a.get("mean_reward")} for a in exp.get("arms", [])],
        "decisions": [{"action": d.get("action"), "arm": d.get("arm"), "reason": str(d.get("reason"))[:160]} for d in decisions],
        "users_rewards": {
            "honest": sum(not r.garbage for r in on),
            "garbage": sum(r.garbage for r in on),
            "by_source": dict(Counter(r.source for r in on)),
        },
    }


async def watch_learner(watch: LearnerWatch, stop: asyncio.Event, interval_s: float, on_poll: Callable[[], None] | None = None) -> None:
    """Polls every ``interval_s`` until ``stop`` is set, then once more."""
    while True:
        await asyncio.to_thread(watch.poll)
        if on_poll is not None:
            on_poll()
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            break
        except TimeoutError:
            continue
    await asyncio.to_thread(watch.poll)


def ask(problem: Any) -> str:
    """What a user types: the task's prompt without its format example. A user does not write "for example
    <answer>42</answer>", and SmolLM2-135M answers "42" to most prompts that do (greedy, 48 held-out problems of
    basic_arithmetic: 1 right with the example, 13 without)."""
    return EXAMPLE.sub(".", problem.prompt)


# ---- held-out: the champion vs the base model on the final turn, paired ---------------------------------------------


async def heldout_two_turn(
    url: str, models: list[str], problems: list[Any], task: Any, max_tokens: int, concurrency: int = 8
) -> dict[str, dict[str, list[bool]]]:
    """Each model answers each problem greedily in the focus shape (the problem, its answer, then ``FINAL_ONLY``):
    ``{model: {"first": [...], "final": [...]}}``, one bool per problem in problem order, models interleaved."""
    sem = asyncio.Semaphore(concurrency)
    out = {m: {"first": [False] * len(problems), "final": [False] * len(problems)} for m in models}
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="heldout", max_retries=2, timeout=1800) as client:

        async def one(i: int, p: Any, m: str) -> None:
            messages: list[dict[str, str]] = [{"role": "user", "content": ask(p)}]
            async with sem:
                r = await client.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=max_tokens)  # type: ignore[arg-type]
                first = r.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": first}, {"role": "user", "content": FINAL_ONLY}]
                r = await client.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=max_tokens)  # type: ignore[arg-type]
            out[m]["first"][i] = bool(task.verify(p, first).correct)
            out[m]["final"][i] = bool(task.verify(p, r.choices[0].message.content or "").correct)

        await asyncio.gather(*(one(i, p, m) for i, p in enumerate(problems) for m in models))
    return out


def champion_of(base_url: str, admin_key: str, family: str) -> tuple[str | None, Path | None]:
    """The family's champion (its alias target) and the folder it was loaded from."""
    r = httpx.get(base_url + "/admin/adapters", headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
    r.raise_for_status()
    body = r.json()
    champion = (body.get("aliases") or {}).get(family)
    path = next((a.get("path") for a in body.get("data", []) if a.get("name") == champion), None)
    return champion, Path(path) if path else None


def evaluate(model: str, champion: str | None, path: Path | None, problems: list[Any], task: Any, max_tokens: int) -> dict[str, Any]:
    """A fresh server (no learner, nothing recorded) loads the champion by path + SHA-256; both answer the held-out problems."""
    from bench._rl_harness import HeldoutBootstrap, served_model
    from experiments.agent_eval import spawned_server
    from learner.records.adapter_manifest import manifest_sha256

    key = secrets.token_hex(8)
    flags = ["--no-record"] + (["--adapter-root", str(path.parent.parent)] if path else [])
    t0 = time.monotonic()
    with spawned_server(model, key, flags) as url:
        base = served_model(url)
        models = [base]
        if champion and path:
            family, version = champion.split("@")
            body = {"path": str(path), "family": family, "version": int(version), "sha256": manifest_sha256(path)}
            httpx.post(f"{url}/admin/adapters", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=300).raise_for_status()
            models.append(champion)
        per = asyncio.run(heldout_two_turn(url, models, problems, task, max_tokens))
    n = len(problems)
    out: dict[str, Any] = {"n": n, "base": base, "champion": champion, "wall_s": round(time.monotonic() - t0, 1)}
    for turn in ("first", "final"):
        out[turn] = {("champion" if m == champion else "base"): round(sum(v[turn]) / n, 4) for m, v in per.items()}
    if champion and path:
        boot = HeldoutBootstrap({m: {0: v["final"]} for m, v in per.items()}, [0], n)
        point, lo, hi = boot.diff(champion, base)
        out["final_diff"] = {"points": round(100 * point, 1), "ci95": [round(100 * lo, 1), round(100 * hi, 1)]}
    return out


# ---- the benchmark ------------------------------------------------------------------------------------------------


def _line(t0: float, traffic_report: TrafficReport | None, watch: LearnerWatch) -> str:
    s = watch.last.get(FAMILY, {})
    live = ""
    if traffic_report is not None:
        recent = [x for v in traffic_report.final_turn.values() for x in v][-50:]
        live = (
            f"requests {traffic_report.requests()}, 5xx {traffic_report.server_errors()}, final-turn live {sum(recent) / max(1, len(recent)):.2f}; "
        )
    return (
        f"[{(time.time() - t0) / 60:5.1f} min] {live}{FAMILY} {s.get('state')} v{s.get('version')} updates {s.get('updates')} "
        f"champion {s.get('champion')}: {str(s.get('detail', ''))[:90]}"
    )


async def _drive(
    args: argparse.Namespace, url: str, admin_key: str, users: list[User], task: Any, problems: list[Any]
) -> tuple[TrafficReport, LearnerWatch]:
    watch = LearnerWatch(url, admin_key)
    stop = asyncio.Event()
    t0 = time.time()
    box: dict[str, TrafficReport] = {}
    watcher = asyncio.create_task(watch_learner(watch, stop, args.poll_s, lambda: print(_line(t0, box.get("r"), watch), flush=True)))
    try:
        report = await run_users(
            url,
            users,
            task=task,
            problems=problems,
            minutes=args.minutes,
            mix=args.mix,
            seed=args.seed,
            max_tokens=args.max_tokens,
            garbage_rate=args.garbage_rate,
        )
        box["r"] = report
    finally:
        stop.set()
        await watcher
    return report, watch


def main() -> int:
    if sys.argv[1:2] == ["--agents-worker"]:
        return agents_worker()
    sys.path.insert(0, str(ROOT))
    from agents.tasks import get_task

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="wall time of the users' traffic")
    p.add_argument("--users", type=int, default=8, help="simulated users, one API key each, one conversation at a time")
    p.add_argument("--garbage-users", type=int, default=1, help="of them, users who rate at random")
    p.add_argument(
        "--garbage-rate",
        type=int,
        default=1,
        help="conversations each garbage user holds at a time (10: its key rates ten times as often as an honest one)",
    )
    p.add_argument("--model", default="default", help="the served model: default (SmolLM2), tiny, or a local folder")
    p.add_argument("--seed", type=int, default=0, help="the training problems' seed and the users' randomness")
    p.add_argument("--heldout-n", type=int, default=100, help="held-out problems (0: no held-out evaluation)")
    p.add_argument("--heldout-seed", type=int, default=4242)
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"conversation shapes' weights ({', '.join(SHAPES)})")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--task-options", default='{"max_terms": 2, "max_digits": 1}', help="the task's generator config (JSON)")
    p.add_argument("--problems", type=int, default=20000, help="training problems the users draw from (never repeated before this many)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every user request and held-out answer")
    p.add_argument("--poll-s", type=float, default=30.0, help="how often the learner and experiments are polled")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--spawn", action="store_true", help="start serve.py with its default learners (the default)")
    where.add_argument("--url", help="an existing server's root URL (with --admin-key and the users' --api-key)")
    p.add_argument("--admin-key", help="with --url: the server's admin key")
    p.add_argument("--api-key", action="append", default=[], help="with --url: a user's API key (repeat; default: generated, for an open server)")
    p.add_argument("--serve-args", default="", help="extra serve.py flags with --spawn (one string, split like a shell)")
    p.add_argument(
        "--learner-job", action="append", default=[], help="with --spawn: serve.py --learner-job JSON (repeat; replaces its default learners)"
    )
    p.add_argument(
        "--data-dir", type=Path, default=ROOT / "bench" / "results" / "live_traffic_data", help="with --spawn: the server's data folder (emptied)"
    )
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "live_traffic.json")
    args = p.parse_args()
    if args.url and not args.admin_key:
        p.error("--url needs --admin-key (the learner and experiments are read through the admin API)")
    parse_mix(args.mix)
    task = get_task(args.task, **json.loads(args.task_options))
    problems = task.problems(args.problems, seed=args.seed)
    held = task.problems(args.heldout_n, seed=args.heldout_seed) if args.heldout_n > 0 else []
    if args.api_key:
        users = [User(f"user{i}", k, garbage=i >= len(args.api_key) - args.garbage_users) for i, k in enumerate(args.api_key)]
    else:
        users = make_users(args.users, args.garbage_users, args.seed)
    load = os.getloadavg()
    if args.url:
        url, admin_key = args.url.rstrip("/"), args.admin_key
        report, watch = asyncio.run(_drive(args, url, admin_key, users, task, problems))
        champion, path = champion_of(url, admin_key, FAMILY)
    else:
        from experiments.agent_eval import spawned_server

        admin_key = secrets.token_hex(8)
        shutil.rmtree(args.data_dir, ignore_errors=True)
        flags = (
            [a for u in users for a in ("--api-key", u.key)]
            + [a for j in args.learner_job for a in ("--learner-job", j)]
            + shlex.split(args.serve_args)
        )
        with spawned_server(args.model, admin_key, flags, learner=True, data_dir=args.data_dir) as url:
            print(f"server at {url} (data {args.data_dir}); {len(users)} users for {args.minutes:g} min, mix {args.mix}", flush=True)
            report, watch = asyncio.run(_drive(args, url, admin_key, users, task, problems))
            champion, path = champion_of(url, admin_key, FAMILY)
            learner = watch.report(FAMILY, report.ratings)
            others = {f: watch.report(f, report.ratings) for f in watch.last if f != FAMILY}
    if args.url:
        learner = watch.report(FAMILY, report.ratings)
        others = {f: watch.report(f, report.ratings) for f in watch.last if f != FAMILY}
    heldout = evaluate(args.model, champion, path, held, task, args.max_tokens) if held else None
    summary = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "users": len(users),
        "garbage_users": sum(u.garbage for u in users),
        "garbage_rate": args.garbage_rate,
        "mix": parse_mix(args.mix),
        "minutes": args.minutes,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
        "traffic": report.summary(),
        "learner": learner,
        "other_learners": {f: {k: r[k] for k in ("state", "updates", "process_restarts", "crashes", "quarantined")} for f, r in others.items()},
        "poll_errors": watch.poll_errors[:10],
        "heldout": heldout,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(summary, indent=2, default=str))
    t = summary["traffic"]
    print(
        f"\ntraffic: {t['conversations']} conversations in {t['wall_s']:.0f} s, {t['requests']} requests, 5xx {t['server_errors']}, transport errors {t['transport_errors']}"
    )
    print(f"  feedback {t['feedback']}; events {t['events']}; final turn live {t['final_turn_live']}")
    print(
        f"learner {FAMILY}: updates {learner['updates']} (trained {learner['updates_trained']}, {learner['samples_trained']} samples), "
        f"process restarts {learner['process_restarts']}, crashes {learner['crashes']}, quarantined {learner['quarantined']}, champion {learner['champion']}"
    )
    print(f"  unused by reason (summed over updates): {learner['unused']}")
    for e in learner["experiments"]:
        print(f"  experiment {e['name']}: {e['status']} winner {e['winner']}, arms {e['arms']}, users' rewards on its metric {e['users_rewards']}")
    if heldout:
        diff = heldout.get("final_diff")
        vs = f", champion - base {diff['points']:+.1f} points (95% CI {diff['ci95'][0]:+.1f}..{diff['ci95'][1]:+.1f})" if diff else " (no champion)"
        print(f"held-out final turn (greedy, n={heldout['n']}): {heldout['final']}{vs}; first turn {heldout['first']}")
    print(f"results: {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
