"""Serves agents to the runtime: the ``runtime.agent_api.AgentHost`` that ``serve.py`` hands to the app.

Holds the agent configurations (from settings and ``POST /admin/agents``), builds one
:class:`agents.loop.AgentLoop` per agent once the runtime client is bound, and answers the two agent
surfaces:

- chat (``model`` = the agent's name): the loop runs server-side on the request's messages and the
  final answer comes back as the assistant message, with ``loopwise`` ids (trajectory, last turn,
  turns used, stop reason) for feedback;
- runs (``POST /v1/agents/{name}/runs``): the whole trajectory (turns, tool calls, observations,
  verdicts). A run may name a task problem (``{"task": "calc_arith", "problem_index": 3, "seed": 0}``);
  then the prompt comes from the task and its verifier's reward is attached to the trajectory.

Not here: HTTP details (``runtime/app.py``), the loop itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agents.config import AgentConfig
from agents.loop import AgentLoop, BranchMismatch, RunResult
from agents.reves import reves_run
from agents.run_state import Branch, Segment
from agents.t2po import MAX_RUN_SEED
from agents.tasks import Problem, Task, get_task
from agents.tasks.variants import signature, synthesize, variant_seed
from learner.records import Trajectory, Turn
from memory.copilot import Copilot
from memory.store import MemoryQueries
from runtime.agent_api import AgentAnswer, RunNotFound, RuntimeClient
from tools.registry import ToolRegistry


class BranchRequest(BaseModel):
    """``branch`` of a run (admin API only): re-roll a recorded task run from its turn ``turn`` (``agents.run_state.Branch``).

    The backbone is read from the interaction store: its outputs and observations are replayed as recorded,
    so a caller names what to replay but never supplies it."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str = Field(max_length=200, description="the backbone: a recorded run of this agent on a task problem")
    turn: int = Field(ge=0, le=63, description="the branch turn t: turns 0..t-1 are replayed, sampling starts at t")
    context_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="optional check: sha256 of the backbone's context ids at turn t (int32 little-endian)"
    )
    kind: Literal["rtpo", "rtpo_refresh", "tcpo", "patr"] = Field(
        "rtpo",
        description=(
            "the learner's purpose: RTPO sibling, RTPO refresh of a backbone's continuation, TCPO counterfactual, or a PATR tree "
            "segment (with segment; the backbone is a PATR path and turn may be its length: continue a paused path)"
        ),
    )


class RevesRequest(BaseModel):
    """``reves`` of a run (admin API only): a REVES repair or verification prompt on the run's task problem (``agents/reves.py``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["repair", "verify"] = Field(description="repair: fix the previous answer (task verifier); verify: judge it (verdict match)")
    previous: str = Field(max_length=65_536, description="the model's previous full answer (repair) or the candidate answer to judge (verify)")


class SegmentRequest(BaseModel):
    """``segment`` of a run (admin API only): a PATR tree segment (``agents.run_state.Segment``): sample at most ``turns`` turns, then pause."""

    model_config = ConfigDict(extra="forbid")

    tree: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$", description="the tree's id (meta patr_tree)")
    turns: int = Field(1, ge=1, le=64, description="turns to sample before pausing")


class RunRequest(BaseModel):
    """The body of ``POST /v1/agents/{name}/runs``."""

    model_config = ConfigDict(extra="forbid")

    input: str | None = Field(None, description="the user message (or give messages, or a task problem)")
    messages: list[dict[str, Any]] | None = Field(None, description="a conversation of {role, content} messages")
    task: str | None = Field(None, description="a task name; with problem_index, the prompt comes from the task and its verifier rewards the run")
    task_options: dict[str, Any] = Field(default_factory=dict)
    problem_index: int | None = Field(None, ge=0, le=100_000)
    problem_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="a task problem by its id as runs report it (``kernels/level1/relu``), instead of problem_index",
    )
    # at most MAX_RUN_SEED (about 4.6e15): a turn's seed is seed · 1000 + turn, within int64 and below T²PO's resample seeds
    seed: int | None = Field(None, ge=0, le=MAX_RUN_SEED, description="problem seed (with task); also the sampling seed unless sample_seed is given")
    sample_seed: int | None = Field(None, ge=0, le=MAX_RUN_SEED, description="sampling seed (several samples of one problem for a learning group)")
    model: str | None = Field(None, description="override the agent's model: base name, alias or family@N")
    max_turns: int | None = Field(None, ge=1, le=64)
    horizon: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "a fixed-horizon training run: exactly this many turns with the agent's format and feedback but no early stop "
            "(the SVR training rollouts; meta horizon); replaces max_turns"
        ),
    )
    user: str | None = Field(None, description="the end user (the session key when no X-Session-Id header is sent)")
    eval: bool = Field(False, description="an evaluation run on held-out problems: recorded, rewarded, never trained on")
    branch: BranchRequest | None = Field(None, description="re-roll a recorded run of the same task problem from one of its turns (learner)")
    reves: RevesRequest | None = Field(None, description="a REVES repair or verification prompt on the task problem (learner; admin only)")
    segment: SegmentRequest | None = Field(None, description="a PATR tree segment: sample some turns, then pause (learner)")
    group: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$",
        description="a learner group tag: runs of one problem with different tags are never compared (e.g. LEAP's single-turn probes)",
    )

    @model_validator(mode="after")
    def _one_input(self) -> RunRequest:
        given = [x for x in (self.input, self.messages, self.problem_index, self.problem_id) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of input, messages, or (task and) problem_index or problem_id")
        if self.branch is not None and (self.problem_index is None or self.eval):
            raise ValueError("branch: re-rollouts need the backbone's task problem (problem_index) and are never eval runs")
        if self.reves is not None and ((self.problem_index is None and self.problem_id is None) or self.branch is not None):
            raise ValueError("reves: a repair or verification prompt needs a task problem (problem_index or problem_id) and no branch")
        if self.segment is not None and (self.problem_index is None or self.eval):
            raise ValueError("segment: PATR segments need a task problem (problem_index) and are never eval runs")
        if self.branch is not None and (self.branch.kind == "patr") != (self.segment is not None):
            raise ValueError("branch: kind 'patr' continues a PATR path and needs segment; other kinds cannot have one")
        if self.messages is not None:
            for i, m in enumerate(self.messages):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                    raise ValueError(f"messages[{i}] must be {{'role': 'system'|'user'|'assistant', 'content': str}}")
        return self


class VariantsRequest(BaseModel):
    """The body of ``POST /admin/agents/{name}/variants``: RODS's synthesis for one problem (``agents/tasks/variants.py``)."""

    model_config = ConfigDict(extra="forbid")

    task: str | None = Field(None, description="the task (default: the agent's)")
    problem_index: int = Field(ge=0, le=100_000)
    seed: int = Field(0, ge=0)
    k: int = Field(4, ge=1, le=32, description="variants wanted")
    variant_seed: int | None = Field(None, ge=0, description="the problem seed searched for variants (default: derived from the problem's id)")
    max_candidates: int = Field(256, ge=1, le=1024, description="problems of variant_seed looked at, at most")
    exclude: list[str] = Field(default_factory=list, max_length=4096, description="problem ids that are not new (already in the pool)")


class ProblemCache:
    """Problem ``i`` of a task and seed without regenerating ``i + 1`` problems per run.

    Problems are generated in growing blocks; a block is reused only if it agrees with the previous one
    on their common prefix (the tasks here are prefix-stable: ``problems(n)[i] == problems(m)[i]``);
    otherwise problem ``i`` is taken from ``problems(i + 1)`` exactly as the task defines it. The cache is
    bounded: at most ``max_lists`` (task, seed) lists, least recently used first out, and a list longer than
    ``max_problems`` is never kept (a run asking for problem 100 000 of a fresh seed costs that run, once).
    Thread-safe (runs look problems up in worker threads).
    """

    def __init__(self, max_lists: int = 16, max_problems: int = 4096) -> None:
        self.max_lists, self.max_problems = max_lists, max_problems
        self._lists: OrderedDict[tuple[int, int], list[Problem]] = OrderedDict()
        self._tasks: dict[int, Task] = {}  # holds each cached list's task, so its id() is not reused meanwhile
        self._stable: dict[tuple[int, int], bool] = {}
        self._ids: OrderedDict[tuple[int, int], tuple[Task, dict[str, int], bool]] = OrderedDict()  # index_of's lookups
        self._lock = threading.Lock()

    def get(self, task: Task, index: int, seed: int) -> Problem:
        key = (id(task), seed)
        with self._lock:
            have = self._lists.get(key, [])
            stable = self._stable.get(key, True)
            if key in self._lists:
                self._lists.move_to_end(key)
        if index < len(have) and stable:
            return have[index]
        if not stable or index + 1 > self.max_problems:
            return task.problems(index + 1, seed=seed)[index]
        fresh = task.problems(min(self.max_problems, max(index + 1, 2 * len(have), 64)), seed=seed)
        ok = [p.id for p in fresh[: len(have)]] == [p.id for p in have] and all(a.prompt == b.prompt for a, b in zip(fresh, have, strict=False))
        with self._lock:
            self._stable[key] = ok
            self._lists[key] = fresh
            self._tasks[id(task)] = task
            self._lists.move_to_end(key)
            while len(self._lists) > self.max_lists:
                old, _ = self._lists.popitem(last=False)
                self._stable.pop(old, None)
                if not any(k[0] == old[0] for k in self._lists):
                    self._tasks.pop(old[0], None)
        return fresh[index] if ok or not have else task.problems(index + 1, seed=seed)[index]

    def index_of(self, task: Task, problem_id: str, seed: int) -> int:
        """The index of the problem named ``problem_id`` among the first ``max_problems`` of ``task`` (ValueError if none)."""
        key = (id(task), seed)
        with self._lock:
            known = self._ids.get(key)
        if known is None or (problem_id not in known[1] and not known[2]):
            n, problems = 64, []
            while True:
                problems = task.problems(n, seed=seed)
                if any(p.id == problem_id for p in problems) or len(problems) < n or n >= self.max_problems:
                    break
                n = min(2 * n, self.max_problems)
            known = (task, {p.id: i for i, p in enumerate(problems)}, len(problems) < n or n >= self.max_problems)
            with self._lock:  # (the task, its ids, whether that is all of them), the newest few (task, seed) pairs
                self._ids[key] = known
                while len(self._ids) > self.max_lists:
                    self._ids.popitem(last=False)
        if problem_id not in known[1]:
            raise ValueError(f"problem_id: no problem {problem_id!r} in task {task.name!r} (seed {seed}) among its first {len(known[1])}")
        return known[1][problem_id]

    def __len__(self) -> int:
        return len(self._lists)


class ServedAgentImpl:
    """One agent as the runtime sees it (``runtime.agent_api.ServedAgent``)."""

    def __init__(self, config: AgentConfig, loop: AgentLoop, tasks: Callable[[str, dict[str, Any]], Task], copilot: Copilot | None = None) -> None:
        self.name = config.name
        self.copilot = copilot  # memory: read before each run, rewritten in the background after it (memory/copilot.py)
        self.config = config
        self.loop = loop
        self._tasks = tasks
        self._problems = ProblemCache()

    def card(self) -> dict[str, Any]:
        c = self.config
        return {
            "name": c.name,
            "description": c.description,
            "tools": list(c.tools),
            "model": c.model,
            "stop_policy": c.stop_policy,
            "stop_params": c.stop_params,
            "max_turns": c.max_turns,
            "token_budget": c.token_budget,
            "task": c.task,
            "t2po": c.t2po.model_dump(),
            "memory": c.memory.model_dump() if c.memory is not None else None,
        }

    async def chat(self, messages: list[dict[str, Any]], *, session_id: str, request_id: str, options: dict[str, Any]) -> AgentAnswer:
        """Answer a chat-style request. ``options``: ``seed``; from frameworks also ``tools`` (the client's, chat-shaped),
        ``tool_choice`` (``auto``/``required``/``{"name"}``) and ``output_format`` (``{"kind", "schema"}``); see
        :meth:`agents.loop.AgentLoop.for_client`."""
        loop = self.loop
        tools, choice, fmt = options.get("tools") or [], options.get("tool_choice"), options.get("output_format")
        if tools or fmt:
            forced = tools and (choice == "required" or isinstance(choice, dict))
            finalize = None
            if forced:
                finalize = ("tool", await loop.client.constraint(tools, choice, None))
            elif fmt:
                finalize = ("format", await loop.client.constraint([], None, fmt))
            loop = loop.for_client(tools, finalize)  # type: ignore[arg-type]
        ticket = await self.copilot.prepare(messages, session_id=session_id) if self.copilot is not None else None
        seed = options.get("seed")  # a chat request's seed is any int64: folded into a run's seeds (seed · 1000 + turn stays int64)
        seed = None if seed is None else int(seed) % (MAX_RUN_SEED + 1)
        result = await loop.run(ticket.messages if ticket else messages, session_id=session_id, request_id=request_id, seed=seed)
        if ticket is not None and self.copilot is not None:
            self.copilot.after(ticket, messages, result)
        return AgentAnswer(
            content=result.answer,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            loopwise=_ids(result),
            tool_calls=list(result.tool_calls),
        )

    async def run(self, body: dict[str, Any], *, session_id: str, request_id: str, admin: bool = False) -> dict[str, Any]:
        try:
            req = RunRequest.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise ValueError(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None
        if (req.branch is not None or req.segment is not None) and not admin:
            raise PermissionError("branch, segment: re-rollouts are for the learner and admins (POST /admin/agents/{name}/runs)")
        if req.reves is not None and not admin:
            raise PermissionError("reves: augmentation prompts are for the learner and admins (POST /admin/agents/{name}/runs)")
        if req.task_options and not admin:
            # options set resources (a sandbox's time and memory, turn caps, problem sizes): the agent's own apply
            raise PermissionError("task_options are for admins (POST /admin/agents/{name}/runs); runs use the agent's configured options")
        turns = req.horizon or req.max_turns
        if turns is not None and turns > self.config.max_turns and not admin:
            # a run's turns are its cost (each one a generation); a tenant may ask for fewer than the agent's cap, not more
            field = "horizon" if req.horizon is not None else "max_turns"
            raise ValueError(f"{field}: {turns} is above agent {self.config.name!r}'s max_turns ({self.config.max_turns}); admins may raise it")
        branch = await self._branch(req) if req.branch is not None else None
        problem: Problem | None = None
        loop = self.loop
        if req.problem_index is not None or req.problem_id is not None:
            name = req.task or self.config.task
            if name is None:
                raise ValueError(f"{'problem_index' if req.problem_id is None else 'problem_id'} needs a task (the agent has none configured)")
            # the agent's options are its own task's: another task named by the run gets its defaults (they raised TypeError)
            own = dict(self.config.task_options) if name == self.config.task else {}
            task = self._tasks(name, req.task_options or own)
            if req.problem_id is not None:  # the index, so the run records (and can be branched) like an indexed one
                index = await asyncio.to_thread(self._problems.index_of, task, req.problem_id, req.seed or 0)
                req = req.model_copy(update={"problem_index": index})
            assert req.problem_index is not None
            try:
                problem = await asyncio.to_thread(self._problems.get, task, req.problem_index, req.seed or 0)  # generating can take a while
            except IndexError:  # a task with a fixed set (HumanEval's 164, the kernel suite) has fewer
                raise ValueError(f"problem_index {req.problem_index} is beyond the problems of task {name!r}") from None
            prompt = problem.prompt
            if req.reves is not None:  # the verify kind's label is the task verifier on the candidate: off the event loop
                task, prompt = await asyncio.to_thread(reves_run, req.reves.kind, req.reves.previous, task, problem)
            if task is not loop.task:
                loop = AgentLoop(self.config, loop.client, loop.tools, task=task, rewrite=loop.rewrite)
            messages = [{"role": "user", "content": prompt}]
        elif req.input is not None:
            messages = [{"role": "user", "content": req.input}]
        else:
            messages = list(req.messages or [])
        # eval runs and re-rollouts (whose context must hash like the recorded one) neither read nor rewrite memory
        use_memory = self.copilot is not None and not req.eval and req.branch is None and req.segment is None
        ticket = await self.copilot.prepare(messages, session_id=session_id) if use_memory and self.copilot is not None else None
        result = await loop.run(
            ticket.messages if ticket else messages,
            session_id=session_id,
            request_id=request_id,
            problem=problem,
            seed=req.sample_seed if req.sample_seed is not None else req.seed,
            model=req.model,
            max_turns=req.max_turns,
            eval_run=req.eval,
            branch=branch,
            problem_ref=(req.problem_index, req.seed or 0) if problem is not None and req.problem_index is not None else None,
            group=req.group,
            horizon=req.horizon,
            segment=Segment(req.segment.tree, req.segment.turns) if req.segment is not None else None,
        )
        if ticket is not None and self.copilot is not None:
            self.copilot.after(ticket, messages, result)
        out = result.to_dict()
        out["object"] = "agent.run"
        if problem is not None:
            out["problem"] = {"id": problem.id, "prompt": problem.prompt, "answer": _jsonable(problem.answer)}
        return out

    async def variants(self, body: dict[str, Any]) -> dict[str, Any]:
        """Up to ``k`` variants of a task problem with its structure, each validated by the task's verifier (``agents/tasks/variants.py``)."""
        try:
            req = VariantsRequest.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise ValueError(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None
        name = req.task or self.config.task
        if name is None:
            raise ValueError("variants need a task (the agent has none configured)")
        task = self._tasks(name, dict(self.config.task_options))
        problem = await asyncio.to_thread(self._problems.get, task, req.problem_index, req.seed)
        seed = req.variant_seed if req.variant_seed is not None else variant_seed(problem.id)
        synth = await asyncio.to_thread(
            synthesize, task, problem, k=req.k, seed=seed, max_candidates=req.max_candidates, exclude=frozenset(req.exclude)
        )
        return {**synth.to_dict(), "problem": {"id": problem.id, "signature": signature(task, problem)}, "variant_seed": seed}

    async def _branch(self, req: RunRequest) -> Branch:
        """The recorded backbone of ``req.branch``, checked: this agent's trainable run of the same task problem."""
        b = req.branch
        assert b is not None
        traj = await self.loop.client.trajectory(b.trajectory_id)
        if traj is None:
            raise RunNotFound(f"branch: no recorded trajectory {b.trajectory_id!r}")
        m = traj.meta
        where = f"branch of {b.trajectory_id}"
        patr = b.kind == "patr"
        if (
            m.get("agent") != self.name
            or (m.get("rerollout") != "patr" if patr else m.get("rerollout"))
            or m.get("eval")
            or m.get("trainable", True) is False
        ):
            what = "a PATR segment" if patr else "a trainable run"
            raise BranchMismatch(f"{where}: not {what} of agent {self.name!r} (other branches, eval runs and broken runs are not replayed)")
        task = req.task or self.config.task
        if (m.get("task"), m.get("problem_index"), m.get("problem_seed") or 0) != (task, req.problem_index, req.seed or 0):
            raise BranchMismatch(f"{where}: it ran task {m.get('task')!r} problem {m.get('problem_index')} (seed {m.get('problem_seed') or 0})")
        turns = await self._patr_path(traj, where) if patr else list(traj.turns)
        pending = None
        if patr and b.turn == len(turns):
            if not m.get("paused") or not isinstance(m.get("pending"), list):
                raise BranchMismatch(f"{where}: the path ended (only a paused PATR path continues at its end)")
            pending = tuple(dict(x) for x in m["pending"])
        elif not b.turn < len(turns):
            raise BranchMismatch(f"{where}: turn {b.turn} is past its {len(turns)} turns")
        branch = Branch(backbone=tuple(turns[: b.turn + 1]), turn=b.turn, of=traj.trajectory_id, kind=b.kind, pending=pending)
        if b.context_sha256 is not None and b.context_sha256 != branch.context_sha256:
            raise BranchMismatch(f"{where}: context_sha256 differs from the recorded context at turn {b.turn}")
        return branch

    async def _patr_path(self, traj: Trajectory, where: str) -> list[Turn]:
        """A PATR path's turns from the root: each segment's ancestors (meta ``branch_of``, same tree) up to its branch turn, then its own."""
        segments = [traj]
        while segments[-1].meta.get("branch_of"):
            if len(segments) > 64:
                raise BranchMismatch(f"{where}: the PATR path is longer than 64 segments")
            parent = await self.loop.client.trajectory(str(segments[-1].meta["branch_of"]))
            if parent is None or parent.meta.get("rerollout") != "patr" or parent.meta.get("patr_tree") != traj.meta.get("patr_tree"):
                raise BranchMismatch(f"{where}: an ancestor of the PATR path is missing or not a segment of its tree")
            segments.append(parent)
        turns: list[Turn] = []
        for seg in reversed(segments):
            start = int(seg.meta.get("branch_turn") or 0) if seg.meta.get("branch_of") else 0
            turns = turns[:start] + list(seg.turns)
        if [t.index for t in turns] != list(range(len(turns))):
            raise BranchMismatch(f"{where}: the PATR path's turns do not line up")
        return turns


class Host:
    """``runtime.agent_api.AgentHost``: agents by name, built when the runtime client is bound."""

    def __init__(
        self,
        configs: Sequence[AgentConfig | dict[str, Any]],
        tools: ToolRegistry,
        reserved: Callable[[str], bool] | None = None,
        memory: MemoryQueries | None = None,  # the SQLite file (memory.store) or the PostgreSQL tables (memory.store_pg)
    ) -> None:
        self.tools = tools
        self.memory = memory  # the memory store, for agents with memory in their config
        self.reserved = reserved or (lambda name: False)
        self._configs: dict[str, AgentConfig] = {}
        self._agents: dict[str, ServedAgentImpl] = {}
        self._client: RuntimeClient | None = None
        self._task_cache: dict[tuple[str, str], Task] = {}
        for c in configs:
            cfg = c if isinstance(c, AgentConfig) else AgentConfig.model_validate(c)
            if cfg.name in self._configs:
                raise ValueError(f"two agents are named {cfg.name!r}")
            self._check_tools(cfg)
            self._configs[cfg.name] = cfg

    def bind(self, client: RuntimeClient) -> None:
        self._client = client
        for cfg in self._configs.values():
            self._agents[cfg.name] = self._build(cfg)

    def get(self, name: str) -> ServedAgentImpl | None:
        return self._agents.get(name)

    def names(self) -> list[str]:
        return list(self._configs)

    def describe(self) -> list[dict[str, Any]]:
        return [a.card() for a in self._agents.values()] if self._client else [{"name": n} for n in self._configs]

    def create(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate and add an agent (``POST /admin/agents``); ValueError names what is wrong."""
        try:
            cfg = AgentConfig.model_validate(config)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise ValueError(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None
        if cfg.name in self._configs:
            raise FileExistsError(f"an agent named {cfg.name!r} exists; delete it first")
        if self.reserved(cfg.name):
            raise FileExistsError(f"{cfg.name!r} is already a model or adapter name")
        self._check_tools(cfg)
        agent = self._build(cfg) if self._client is not None else None
        self._configs[cfg.name] = cfg
        if agent is not None:
            self._agents[cfg.name] = agent
            return agent.card()
        return {"name": cfg.name}

    def delete(self, name: str) -> bool:
        self._agents.pop(name, None)
        return self._configs.pop(name, None) is not None

    # ---- helpers
    def _check_tools(self, cfg: AgentConfig) -> None:
        missing = [t for t in cfg.tools if t not in self.tools.names()]
        if missing:
            raise ValueError(f"agent {cfg.name!r}: unknown tools {', '.join(missing)}; known: {', '.join(self.tools.names()) or 'none'}")
        if cfg.task is not None:
            self._task(cfg.task, dict(cfg.task_options))  # an unknown task or bad options fail now, not mid-run
        if cfg.memory is not None:
            if self.memory is None:
                raise ValueError(f"agent {cfg.name!r}: memory needs a memory store, and this host has none")
            if cfg.memory.max_chars > self.memory.max_chars:  # the store would refuse its rewrites: memory silently stays old
                raise ValueError(
                    f"agent {cfg.name!r}: memory.max_chars {cfg.memory.max_chars} is over the memory store's limit of"
                    f" {self.memory.max_chars} (--memory-max-chars)"
                )

    def _task(self, name: str, options: dict[str, Any]) -> Task:
        key = (name, repr(sorted(options.items())))
        if key not in self._task_cache:
            self._task_cache[key] = get_task(name, **options)
            while len(self._task_cache) > 32:  # bounded: distinct (task, options) come from admins, but never without end
                self._task_cache.pop(next(iter(self._task_cache)))
        return self._task_cache[key]

    def _build(self, cfg: AgentConfig) -> ServedAgentImpl:
        assert self._client is not None
        task = self._task(cfg.task, dict(cfg.task_options)) if cfg.task else None
        copilot = Copilot(cfg.memory, self.memory, self._client, cfg.name) if cfg.memory is not None and self.memory is not None else None
        return ServedAgentImpl(cfg, AgentLoop(cfg, self._client, self.tools, task=task), self._task, copilot)


def _ids(result: RunResult) -> dict[str, Any]:
    return {
        "trajectory_id": result.trajectory_id,
        "turn_id": result.last_turn_id,
        "agent": result.agent,
        "adapter": result.adapter,
        "turns": result.turns,
        "stop_reason": result.stop_reason,
        "trainable": result.trainable,
    }


def _jsonable(x: Any) -> Any:
    return x if isinstance(x, str | int | float | bool | type(None) | list | dict) else str(x)
