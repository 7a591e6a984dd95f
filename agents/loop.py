"""The agent loop: a state machine over exact token ids (generate → parse → run tools → observe → decide).

The run's state, its phases and the one rule that ends it are ``agents/run_state.py`` (``RunState``, ``Phase``,
``ending``, and the parts a run is made of: ``Branch``, ``Segment``, ``ContextTracker``, ``StepRecord``);
``AgentLoop`` has one handler per phase (``_begin``, ``_generate_turn``, ``_score``, ``_replay``, ``_act``,
``_observe``) and ``_run`` drives them until ``ending`` says stop.

One run is one trajectory. Every model call is one recorded turn: its context ids are exactly what the
engine was given, its output ids exactly what it produced (loss mask 1); tool results, policy feedback
and T²PO's forced text live only in later turns' contexts, so they are never trained on.

**Prefix invariant.** Each next context is built as ``previous context + output ids + observation
ids``, where the observation ids are what the chat template puts between the end of the model's turn
and the next generation prompt (rendered around a sentinel, never by re-tokenizing the model's own
text). :class:`ContextTracker` checks the invariant on every turn; anything that rewrites the context
instead (a ``rewrite`` hook, e.g. a memory copilot editing the system prompt) is checked the same way,
and a break marks the trajectory untrainable (``meta.trainable = false``) rather than failing the run.
Whether a full re-render of the messages would tokenize differently is recorded as ``drift_turns``
(information only: training uses the ids the model actually saw).

**Stopping.** Turns with tool calls run the tools (arguments validated; errors go back to the model as
observations) and continue. Other turns go to the stop policy (``agents.policies``): it stops with an
answer or continues with feedback (the next user message). The turn cap, the token budget and the
context window also stop a run; then the policy picks the answer from the history.

**T²PO** (both off by default): with ``thinking_intervention`` the turn is streamed and, when the
thinking uncertainty plateaus inside an open ``<think>`` span, generation is cut and resumed after a
forced ``</think>`` within the same turn (one recorded turn: thinking, the forced tokens with loss mask
0, the answer; it does not use up a turn of ``max_turns``); with ``turn_resample`` a turn whose
uncertainty barely moved from the previous turn is regenerated at most ``max_try`` times from the same
context and sampling (grammar included) with a fresh seed per draft (``agents.t2po.resample_seed``; discarded
drafts are recorded as branches, ``meta.resampled_draft = true``). The thinking is cut right after the token
the monitor fires at, also inside an engine stream chunk of several tokens.

**Constraints.** A turn decoded under a grammar (the svr / svr_r1 format) records it in
``sampling["grammar"]`` (kind and spec), so the learner scores it under the same mask the engine used.

**Re-rollouts (branches).** A run may start as a *branch* of a recorded trajectory (:class:`Branch`, built
from the store by the host, never from a caller's data): turns ``0..t-1`` are replayed as recorded, their
outputs and the observations that followed them (tool results are not computed again, so no tool runs
twice; an environment is stepped with the recorded outputs to reach its state at turn ``t``, and its
observations must match the recorded ones), each next context is the recorded one, and sampling starts
at turn ``t`` from the backbone's exact recorded context. The agent's first context must equal the
backbone's (else :class:`BranchMismatch`, and nothing is recorded: its configuration or the problem changed).
Only the sampled turns are recorded, in a new trajectory whose first turn's parent is the backbone's
turn ``t-1`` and whose meta names the backbone (``branch_of``, ``branch_turn``, ``anchor`` = the
context's sha256, ``rerollout`` = the learner's purpose). The learner uses this for RTPO siblings and
TCPO counterfactuals (``learner/rerollout.py``). T²PO-intervened backbones cannot be replayed.

**Segments (PATR's tree rollouts).** A run with a :class:`Segment` samples at most ``segment.turns`` turns
and then *pauses*: stop reason ``paused``, no answer and no verifier reward; the observation that would
follow its last turn is recorded in its meta (``pending``) with the task's process score of the prefix
(``prefix_score``, the task's ``score_prefix``), and the trajectory is marked ``rerollout = "patr"`` with
its tree id (``patr_tree``). A branch of such a path (the host resolves the chain of segments into one
backbone) may start at the path's end (``turn`` = its length): every recorded turn is replayed and the
observation after the last one is the recorded ``pending`` one (the environment is stepped and must
agree; no tool runs again), so the continued context is byte-for-byte what one uninterrupted run would
have had. ``learner/patr.py`` grows its trees this way.

**Verification.** When the run names a task problem, the task's verifier scores the final answer and
the reward is attached to the trajectory (source ``verifier:<task>``); per-turn process scores go on
the turns (``verifier:<task>:process``). Environment tasks (FrozenLake) answer each action turn with
the environment's observation and end when the episode does; the episode's reward is its summed step
rewards clipped to [0, 1] and "correct" means reward 1, unless the last step's ``info`` reports its own
``correct`` (True/False; None = not measured, recorded as such, never as incorrect), the ``reward`` to
record and a ``score`` (the kernel task: a right-but-slow kernel is correct; Kevin's uncapped
``0.3 + speedup`` or LEAP's 1/0 is recorded as the reward, and the meta ``score`` is what LEAP's rank
estimator orders correct kernels by). Environments with a ``state_key()`` have it recorded per turn (meta
``state_keys``, GiGPO's anchor states); a run's ``group`` tag goes to meta ``group``.

Not here: HTTP (``agents/host.py``), tool execution (``tools/``), parsing the self-check formats
(``agents/stop.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Literal, TypeGuard, TypeVar

import structlog

from agents.config import AgentConfig
from agents.policies import make_policy
from agents.prompts import format_grammar
from agents.run_state import Branch, ContextTracker, Phase, RunState, Segment, StepRecord, ToolEvent, ending
from agents.self_checks import fixed_horizon, turn_check
from agents.stop import StopPolicy, TurnView
from agents.t2po import T2POCounters, chunk_cut, intervention_text, resample_seed, thinking_tokens, token_uncertainty, turn_uncertainty
from agents.tasks import Env, Problem, Task
from learner.records import Reward, ToolCallRecord, Turn, TurnCheck, TurnTimings, context_sha256, new_id
from runtime.agent_api import ANONYMOUS, Lease, RunConflict, RuntimeClient, UnknownModel
from runtime.engine import GenerateResult, Grammar, SamplingParams, Timings, TokenLogprob
from tools.registry import ToolRegistry

log = structlog.get_logger(__name__)

FINALIZE_MIN_TOKENS = 512
FINALIZE_PROMPTS = {
    "tool": "Now give your final answer by calling one of the tools.",
    "format": "Now give your final answer in the requested JSON format.",
}
SENTINEL = "\u2063LOOPWISE\u2063SENTINEL\u2063"  # never produced by a tokenizer's decode of normal text


# The task's own code (environments, verifiers, process scores) and a run's templating, off the event loop and on a pool of
# their own: a HumanEval check runs a sandboxed program for seconds and a kernel environment compiles, while the loop serves
# every other request; a burst of heavy runs queues here instead of taking the default executor the rest of the app uses.
_TASK_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="loopwise-task")
_T = TypeVar("_T")


async def _off_loop(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    ctx = contextvars.copy_context()  # the bound caller (runtime.identity) goes along, as with asyncio.to_thread
    return await asyncio.get_running_loop().run_in_executor(_TASK_POOL, functools.partial(ctx.run, fn, *args, **kwargs))


class BranchMismatch(RunConflict):
    """The backbone cannot be replayed here (the agent's first context or the environment's replay differs from the record)."""

    code = "branch_mismatch"
    param = "branch"


# Rewrites the messages before a turn (e.g. a memory copilot); returns None to keep them.
RewriteHook = Callable[[list[dict[str, Any]], int], list[dict[str, Any]] | None]


def json_safe(x: Any) -> Any:
    """``x`` as plain JSON: mappings and sequences recursed, non-finite floats as None, anything else as its str."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, str | int | float | bool):
        return x
    return str(x)


@dataclass
class RunResult:
    run_id: str
    trajectory_id: str
    agent: str
    answer: str
    stop_reason: str
    steps: list[StepRecord]
    prompt_tokens: int
    completion_tokens: int
    trainable: bool
    broken_at: int | None
    drift_turns: int
    adapter: str | None
    elapsed_s: float
    format_failures: int = 0
    p_correct: float | None = None  # the stated P(correct) of the answer (svr / svr_r1), for calibration
    reward: float | None = None
    correct: bool | None = None
    verdict_detail: str | None = None
    task: str | None = None
    task_key: str | None = None
    problem_id: str | None = None
    t2po: dict[str, int] = field(default_factory=dict)
    state_keys: list[str | None] = field(default_factory=list)  # the env's state before each turn (GiGPO's anchors); [] without
    last_turn_id: str | None = None
    eval: bool = False  # an evaluation run (held-out problems): the learner never trains on it
    finish_reason: str = "stop"  # OpenAI's finish reason for the final answer: "length" when a budget ended the run
    problem_index: int | None = None  # which task problem (with problem_seed), so the learner can branch this run later
    problem_seed: int | None = None
    branch_of: str | None = None  # a re-rollout: the backbone trajectory, the branch turn and the context id there
    branch_turn: int | None = None
    anchor: str | None = None
    rerollout: str | None = None
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # calls to the client's tools that ended the run (id, name, arguments)
    group: str | None = None  # a learner group tag (runs of one problem with different tags are never compared)
    score: float | None = None  # an environment's own uncapped score (LEAP's rank key), when it reports one
    info: dict[str, Any] | None = None  # the environment's last structured report (the last step's ``info``), so no caller parses prose
    horizon: int | None = None  # a fixed-horizon training run (``agents/self_checks.py``): no early stop
    prefix_score: float | None = None  # a segment's process score of the run so far (the task's score_prefix)
    pending: list[dict[str, Any]] | None = None  # a paused segment: the observation messages that follow its last turn
    patr_tree: str | None = None  # a segment's tree id

    @property
    def turns(self) -> int:
        return len(self.steps)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["turns"] = self.turns
        return out


@dataclass
class _Final:
    res: GenerateResult
    step: StepRecord
    answer: str
    calls: list[Any]


class AgentLoop:
    """Runs one agent configuration; stateless between runs, so one instance serves concurrent runs."""

    def __init__(
        self, config: AgentConfig, client: RuntimeClient, tools: ToolRegistry, task: Task | None = None, rewrite: RewriteHook | None = None
    ) -> None:
        missing = [t for t in config.tools if t not in tools.names()]
        if missing:
            raise ValueError(f"agent {config.name!r}: unknown tools {', '.join(missing)}; known: {', '.join(tools.names()) or 'none'}")
        self.config = config
        self.client = client
        self.tools = tools
        self.task = task
        self.rewrite = rewrite
        self.tool_schemas = tools.schemas(list(config.tools)) if config.tools else None
        self.tool_names = set(config.tools)
        self.client_tool_names: frozenset[str] = frozenset()
        self.finalize: tuple[str, Grammar] | None = None

    def for_client(self, client_tools: list[dict[str, Any]], finalize: tuple[str, Grammar] | None) -> AgentLoop:
        """This loop for one request from a framework: the client's tools join the agent's (a call to one ends the
        run with that call, as any model's turn would), and ``finalize`` (``("tool" | "format", grammar)``) adds
        one last turn decoded under the grammar when the run ends without such a call: the answer as a forced
        client tool call, or in the requested output format."""
        loop = copy.copy(self)
        own = {t["function"]["name"] for t in client_tools}
        clash = own & self.tool_names
        if clash:
            raise ValueError(f"client tools {', '.join(sorted(clash))} have the names of the agent's own tools")
        loop.tool_schemas = [*(self.tool_schemas or []), *client_tools] or None
        loop.tool_names = self.tool_names | own
        loop.client_tool_names = frozenset(own)
        loop.finalize = finalize
        return loop

    def policy(self) -> StopPolicy:
        return make_policy(self.config.stop_policy, **self.config.stop_params)

    def system_prompt(self, policy: StopPolicy) -> str:
        return f"{self.config.system_prompt}\n\n{policy.instructions}".strip()

    async def run(
        self,
        messages: list[dict[str, Any]],
        *,
        session_id: str,
        request_id: str | None = None,
        problem: Problem | None = None,
        seed: int | None = None,
        model: str | None = None,
        max_turns: int | None = None,
        eval_run: bool = False,
        branch: Branch | None = None,
        problem_ref: tuple[int, int] | None = None,
        group: str | None = None,
        horizon: int | None = None,
        segment: Segment | None = None,
    ) -> RunResult:
        """Run to a stop. ``messages``: the conversation so far (system messages are merged after the agent's).

        ``branch``: replay a recorded trajectory's first turns and sample from there (module docstring).
        ``problem_ref``: ``(problem_index, problem_seed)`` of ``problem``, recorded so the learner can branch the run.
        ``group``: a learner group tag (meta ``group``): runs of one problem with different tags are never compared.
        ``horizon``: a fixed-horizon training run of exactly ``horizon`` turns (budgets permitting), with the agent's
        format and feedback but no early stop (``agents.self_checks.fixed_horizon``; meta ``horizon``).
        ``segment``: sample at most ``segment.turns`` turns, then pause (module docstring: segments)."""
        cfg = self.config
        policy = self.policy() if horizon is None else fixed_horizon(self.policy())
        request_id = request_id or uuid.uuid4().hex
        # A/B arms are sticky per session; runs without one are routed independently, by their request id
        lease = self._lease(model, session_id if session_id != ANONYMOUS else f"run-{request_id}")
        try:
            result = await self._run(
                policy, lease, messages, session_id, request_id, problem, seed, horizon or max_turns or cfg.max_turns, eval_run, branch, problem_ref,
                group, horizon, segment,
            )  # fmt: skip
        finally:
            self.client.release(lease)
        return result

    def _lease(self, model: str | None, route_key: str) -> Lease:
        """The version serving this run: an explicit model, else the family's champion once it exists, else the agent's model."""
        if model is not None:
            return self.client.acquire(model, route_key)
        if self.config.adapter_family is not None:
            try:
                return self.client.acquire(self.config.adapter_family, route_key)
            except UnknownModel:
                log.debug("no version of the family yet; serving the agent's model", family=self.config.adapter_family)
        return self.client.acquire(self.config.model or self.client.model_id, route_key)

    # ---- the state machine (agents/run_state.py: the state, the phases, when a run ends) ----------------
    async def _run(
        self,
        policy: StopPolicy,
        lease: Lease,
        messages: list[dict[str, Any]],
        session_id: str,
        request_id: str,
        problem: Problem | None,
        seed: int | None,
        max_turns: int,
        eval_run: bool = False,
        branch: Branch | None = None,
        problem_ref: tuple[int, int] | None = None,
        group: str | None = None,
        horizon: int | None = None,
        segment: Segment | None = None,
    ) -> RunResult:
        if branch is not None:
            self._check_branch(branch, max_turns)
        s = await _off_loop(self._start, policy, lease, messages, session_id, request_id, problem, seed, max_turns, branch)
        if segment is not None:  # pause after segment.turns sampled turns (``ending``)
            s.segment, s.pause_at = segment, (branch.turn if branch is not None else 0) + segment.turns
        phase = Phase.BEGIN
        while (stop := ending(s, phase)) is None:
            phase = await self._phases[phase](self, s)
        s.stop_reason, s.finish = stop.reason, stop.finish
        if stop.answered:
            s.msgs += [{"role": "assistant", "content": s.text}]
        if not s.branched:
            assert branch is not None
            where = f"branch of {branch.of or 'a trajectory'} at turn {branch.turn}"
            raise BranchMismatch(f"{where}: the replayed run stopped at turn {s.turn} ({s.stop_reason})")
        result = await _off_loop(self._result, s, await self._answer(s), eval_run, problem_ref, group)
        result.horizon = horizon
        await self._finish(result)
        return result

    def _start(
        self, policy: StopPolicy, lease: Lease, messages: list[dict[str, Any]], session_id: str, request_id: str, problem: Problem | None,
        seed: int | None, max_turns: int, branch: Branch | None,
    ) -> RunState:  # fmt: skip
        """The run's first context: the agent's system prompt (with the caller's system messages), the conversation,
        the environment's first observation; a branch must start from its backbone's exact first context."""
        cfg = self.config
        env: Env | None = self.task.make_env(problem) if self.task is not None and problem is not None else None
        system = self.system_prompt(policy)
        extra_system = "\n\n".join(m.get("content") or "" for m in messages if m["role"] == "system")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": f"{system}\n\n{extra_system}".strip()}]
        msgs += [dict(m) for m in messages if m["role"] != "system"]
        if env is not None:
            first = env.reset()  # the first observation joins the task's prompt
            if msgs[-1]["role"] == "user":
                msgs[-1] = {**msgs[-1], "content": f"{msgs[-1]['content']}\n\n{first}"}
            else:
                msgs.append({"role": "user", "content": first})
        ctx = ContextTracker(self.client.render(msgs, self.tool_schemas).token_ids)
        if branch is not None and list(ctx.ids) != list(branch.backbone[0].context_ids):
            raise BranchMismatch(
                f"branch of {branch.of or 'a trajectory'}: the run's first context differs from the recorded one (the agent's configuration "
                "or the problem changed)"
            )
        spec = format_grammar(policy.fmt) if cfg.constrain_format and not self.tool_names and not cfg.t2po.thinking_intervention else None
        return RunState(
            run_id=f"run-{uuid.uuid4().hex}",
            trajectory_id=new_id("traj"),
            request_id=request_id,
            session_id=session_id,
            lease=lease,
            policy=policy,
            problem=problem,
            env=env,
            branch=branch,
            max_turns=max_turns,
            seed=seed,
            grammar=Grammar("ebnf", spec) if spec else None,
            t0=time.perf_counter(),
            msgs=msgs,
            ctx=ctx,
            prompt_tokens=len(ctx.ids),
            counters=T2POCounters(),
            branched=branch is None,
        )

    async def _begin(self, s: RunState) -> Phase:
        """A turn starts: a ``rewrite`` hook may replace the messages (checked against the prefix invariant); the room
        left in the context window and in the token budget is measured (``ending`` stops the run without either)."""
        if self.rewrite is not None and (new_msgs := self.rewrite(s.msgs, s.turn)) is not None:
            s.msgs = new_msgs
            s.ctx.advance(s.turn - 1, [], self.client.render(s.msgs, self.tool_schemas).token_ids)
        s.room = self.client.max_model_len - len(s.ctx.ids)
        s.budget = self.config.token_budget - s.completion_tokens
        return Phase.GENERATE

    async def _generate_turn(self, s: RunState) -> Phase:
        """The turn's output: replayed from the backbone before a branch's turn, else sampled (T²PO may cut its
        thinking or regenerate it); then recorded (sampled turns only) and its tool calls parsed. A call to one of
        the client's tools ends the run (``ending``)."""
        cfg, branch, turn = self.config, s.branch, s.turn
        sampling = SamplingParams(
            max_new_tokens=max(1, min(cfg.max_tokens_per_turn, s.budget, s.room - 1)),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=None if s.seed is None else s.seed * 1000 + turn,
            logprobs=True,
            top_logprobs=cfg.t2po.top_logprobs if (cfg.t2po.thinking_intervention or cfg.t2po.turn_resample) else 0,
            grammar=s.grammar,
        )
        s.state_keys.append(_state_key(s.env))  # the state this turn acts in (replayed turns too: indices are absolute)
        s.forced = branch is not None and turn < branch.turn
        if branch is not None and turn == branch.turn:
            if branch.context_sha256 is not None and context_sha256(s.ctx.ids) != branch.context_sha256:
                where = f"branch of {branch.of or 'a trajectory'} at turn {turn}"
                raise BranchMismatch(f"{where}: the replayed context differs from the recorded one")
            s.branched, s.parent = True, branch.parent_turn_id
        rid = f"{s.request_id}-t{turn}"
        if s.forced:
            assert branch is not None
            res, intervened, s.mask = self._replayed(s.ctx.ids, branch.backbone[turn], rid), False, None
        else:
            res, intervened, s.mask = await self._generate(s.ctx.ids, sampling, s.lease, rid, s.policy)
        u = _turn_uncertainty(res.logprobs, s.mask)
        drafts = 0
        while cfg.t2po.turn_resample and not s.forced and not intervened and u is not None and cfg.t2po.resample(s.prev_u, u, drafts):
            await self._record_draft(res, s.ctx.ids, s.lease, s.session_id, s.run_id, s.parent, turn, s.msgs, s.grammar)
            drafts += 1
            s.counters.resamples += 1
            s.completion_tokens += len(res.output_ids)
            sampling = replace(sampling, seed=resample_seed(s.seed, turn, drafts))  # a fresh seed; keeps the grammar as it is
            res, intervened, s.mask = await self._generate(s.ctx.ids, sampling, s.lease, f"{rid}-r{drafts}", s.policy)
            u = _turn_uncertainty(res.logprobs, s.mask)
        s.res = res
        s.prev_u = u if u is not None else s.prev_u
        s.completion_tokens += len(res.output_ids)  # replayed turns count against the budget, as in the backbone
        s.replayed_tokens += len(res.output_ids) if s.forced else 0
        s.counters.interventions += int(intervened)
        turn_id = new_id("turn")
        s.steps.append(
            StepRecord(
                turn, turn_id, res.text, len(res.output_ids), res.finish_reason, uncertainty=u, intervened=intervened, drafts_discarded=drafts,
                replayed=s.forced,
            )
        )  # fmt: skip
        s.calls = self.client.parse_tool_calls(res.text, self.tool_names).tool_calls if self.tool_names else []
        if not s.forced:
            check = await _off_loop(turn_check, s.policy.fmt, res.text, tool_calls=len(s.calls), task=self.task, problem=s.problem, env=s.env)
            s.step.correct = check.correct if check is not None else None
            await self._record(
                res, s.ctx.ids, turn_id, s.lease, s.session_id, s.run_id, s.parent, turn, s.msgs, s.calls, res.finish_reason, s.trajectory_id,
                s.grammar, s.mask, check,
            )  # fmt: skip
            s.parent = turn_id
        s.client_calls = [c for c in s.calls if c.name in self.client_tool_names]
        if s.client_calls:  # the client runs these tools: the run ends here, the call is the answer
            s.client_text = self.client.parse_tool_calls(res.text, self.tool_names).content or ""
            s.history.append(TurnView(text=res.text, tool_calls=len(s.calls)))
        return Phase.SCORE

    async def _score(self, s: RunState) -> Phase:
        """The task's per-turn process score, recorded as a reward on a sampled turn."""
        if self.task is not None and s.problem is not None:
            step = s.step
            step.process_score = await _off_loop(self.task.process_score, s.problem, s.text)
            if step.process_score is not None and not s.forced:
                source = f"verifier:{self.task.name}:process"
                await self.client.reward(Reward(target="turn", target_id=step.turn_id, value=float(step.process_score), source=source))
        return Phase.REPLAY if s.forced else Phase.ACT

    async def _replay(self, s: RunState) -> Phase:
        """What followed a replayed turn, from the record (``_replay_step``); the next context is the recorded one."""
        assert s.branch is not None and s.res is not None
        ended, reward = self._replay_step(s.branch, s.turn, s.text, s.calls, s.env, s.policy, s.history, s.max_turns, s.step)
        s.env_reward += reward
        if ended is not None:  # the backbone cannot have stopped before the branch turn: refused after the run
            s.replay_end = ended
            return Phase.BEGIN
        if s.turn + 1 == len(s.branch.backbone):  # the end of a paused path: the observation recorded when it paused
            s.observations = [dict(m) for m in s.branch.pending or ()]
            return Phase.OBSERVE
        nxt = s.branch.backbone[s.turn + 1]
        s.msgs = [dict(m) for m in nxt.messages]
        s.ctx.advance(s.turn, s.res.output_ids, list(nxt.context_ids))
        s.turn += 1
        return Phase.BEGIN

    async def _act(self, s: RunState) -> Phase:
        """The turn's tool calls run (errors become observations); a turn without calls steps the environment, if the
        run has one, else goes to the stop policy, whose feedback becomes the next user message."""
        step, s.observations = s.step, []
        for call in s.calls:
            result = await self.tools.call(call.name, call.arguments)
            step.tool_calls.append(
                ToolEvent(call.id, call.name, call.arguments, result.content, result.ok, result.error_kind, dict(result.flags), result.elapsed_s)
            )
            s.observations.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result.content})
        s.history.append(TurnView(text=s.text, tool_calls=len(s.calls)))
        if s.env is not None and not s.calls:
            env_step = await _off_loop(s.env.step, s.text)
            s.env_reward += env_step.reward
            s.env_info = env_step.info
            step.observation = env_step.observation
            step.info = json_safe(env_step.info)
            s.env_done = env_step.done
            if not env_step.done:
                s.observations.append({"role": "user", "content": env_step.observation})
                s.decision = None
            return Phase.OBSERVE
        decision = s.decision = s.policy.decide(s.history, s.max_turns)
        step.decision = decision.reason
        step.format_failure = decision.format_failure
        if decision.check is not None:
            step.verdict, step.confidence = decision.check.verdict, decision.check.confidence
        if not decision.stop and decision.feedback:
            s.observations.append({"role": "user", "content": decision.feedback})
            step.observation = decision.feedback
        return Phase.OBSERVE

    async def _observe(self, s: RunState) -> Phase:
        """The observations join the conversation; the next context is this one + the output + the template's tokens
        around the observations (the prefix invariant), and a full re-render that differs counts as drift."""
        assert s.res is not None
        if not s.observations:  # nothing to say back (e.g. fixed policy without feedback): ask to go on
            s.observations.append({"role": "user", "content": "Continue."})
            s.step.observation = "Continue."
        obs_ids = self._observation_ids(s.msgs, s.res, s.observations)
        s.msgs += [{"role": "assistant", "content": s.text}, *s.observations]
        s.pending = list(s.observations)  # what a segment that pauses here records
        s.ctx.advance(s.turn, s.res.output_ids, [*s.ctx.ids, *s.res.output_ids, *obs_ids])
        if self.client.render(s.msgs, self.tool_schemas).token_ids != tuple(s.ctx.ids):
            s.drift_turns += 1
        s.turn += 1
        return Phase.BEGIN

    _phases: ClassVar[dict[Phase, Callable[[AgentLoop, RunState], Awaitable[Phase]]]] = {
        Phase.BEGIN: _begin,
        Phase.GENERATE: _generate_turn,
        Phase.SCORE: _score,
        Phase.REPLAY: _replay,
        Phase.ACT: _act,
        Phase.OBSERVE: _observe,
    }

    async def _answer(self, s: RunState) -> str:
        """The run's answer: the client's tool call, else the stop policy's (asked again over the whole history when it
        did not stop the run, except in an environment), else the last turn's text; with ``finalize``, one more turn
        under the request's grammar gives it. A paused segment has no answer yet."""
        if s.stop_reason == "paused":
            return ""
        if not s.client_calls and (s.decision is None or not s.decision.stop):
            final = s.policy.decide(s.history, len(s.history)) if s.history else None
            if final is not None and s.env is None:
                s.decision = final
        decision = s.decision
        answer = decision.answer if decision is not None and decision.answer is not None else (s.history[-1].text if s.history else "")
        if s.client_calls:
            answer = s.client_text
        elif self.finalize is not None and s.env is None and s.res is not None:
            fin = await self._finalize(s.ctx, s.msgs, s.res, s.lease, s.session_id, s.run_id, s.parent, len(s.steps), s.trajectory_id)
            s.steps.append(fin.step)
            s.completion_tokens += len(fin.res.output_ids)
            s.parent = fin.step.turn_id
            answer, s.client_calls = fin.answer, fin.calls
            if fin.res.finish_reason == "length":
                s.steps[-1].finish_reason = "length"
        if s.stop_reason == "max_turns" and decision is not None and decision.stop:
            s.stop_reason = decision.reason
        if s.steps and s.steps[-1].finish_reason == "length":
            s.finish = "length"  # the answer's turn was cut by its token limit
        return answer

    def _result(self, s: RunState, answer: str, eval_run: bool, problem_ref: tuple[int, int] | None, group: str | None) -> RunResult:
        """The run as the runs endpoint reports it, with the task's verdict: an environment's episode reward (or the
        outcome its last step reports), else the verifier on the answer."""
        branch, decision = s.branch, s.decision
        result = RunResult(
            run_id=s.run_id,
            trajectory_id=s.trajectory_id,
            agent=self.config.name,
            answer=answer,
            stop_reason=s.stop_reason,
            steps=s.steps,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens - s.replayed_tokens,
            trainable=s.ctx.intact,
            broken_at=s.ctx.broken_at,
            drift_turns=s.drift_turns,
            adapter=s.lease.adapter,
            elapsed_s=time.perf_counter() - s.t0,
            format_failures=sum(x.format_failure for x in s.steps),
            p_correct=decision.p_correct if decision is not None else None,
            t2po=s.counters.as_dict(),
            state_keys=s.state_keys if any(k is not None for k in s.state_keys) else [],
            last_turn_id=s.parent,
            finish_reason=s.finish,
            eval=eval_run,
            tool_calls=[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in s.client_calls],
            info=json_safe(s.env_info) if s.env_info else None,
        )
        result.group = group
        if problem_ref is not None:
            result.problem_index, result.problem_seed = problem_ref
        if branch is not None:
            result.branch_of, result.branch_turn, result.anchor, result.rerollout = branch.of, branch.turn, branch.context_sha256, branch.kind
        paused = s.stop_reason == "paused"
        if s.segment is not None:
            result.patr_tree, result.pending = s.segment.tree, (json_safe(s.pending) if paused else None)
        if self.task is not None and s.problem is not None:
            result.task, result.task_key, result.problem_id = self.task.name, self.task.task_key(s.problem), s.problem.id
            if s.segment is not None:
                result.prefix_score = _prefix_score(self.task, s.problem, s.env, [x.text for x in s.steps], done=not paused)
            if paused:
                pass  # no verdict yet: the path goes on in a later run
            elif s.env is not None:
                env_info = s.env_info
                reward = min(1.0, max(0.0, s.env_reward))
                correct: bool | None = s.env_done and reward >= 1.0
                # an environment may report its own outcome in the last step's info: "correct" (True/False, or None when
                # it could not be measured, e.g. a kernel on a machine without a GPU), the "reward" to record (e.g.
                # Kevin's uncapped 0.3 + speedup, or LEAP's 1/0) and a "score" ranking runs of one problem (meta score)
                if "correct" in env_info:
                    correct = env_info["correct"] if isinstance(env_info["correct"], bool) else None
                recorded = env_info.get("reward", env_info.get("score"))
                if _finite_number(recorded):
                    reward = float(recorded)
                if _finite_number(env_info.get("score")):
                    result.score = float(env_info["score"])
                result.reward, result.correct, result.verdict_detail = reward, correct, "episode reward"
            else:
                verdict = self.task.verify(s.problem, answer)
                result.reward, result.correct, result.verdict_detail = verdict.reward, verdict.correct, verdict.detail
        return result

    # ---- pieces ---------------------------------------------------------------------------------
    async def _finalize(
        self, ctx: ContextTracker, msgs: list[dict[str, Any]], last: GenerateResult, lease: Lease, session_id: str, run_id: str,
        parent: str | None, index: int, trajectory_id: str,
    ) -> _Final:  # fmt: skip
        """One more turn under the request's constraint (a forced client tool call, or an output format)."""
        assert self.finalize is not None
        kind, grammar = self.finalize
        prompt = [{"role": "user", "content": FINALIZE_PROMPTS[kind]}]
        if msgs and msgs[-1]["role"] == "assistant":  # stopped on an answer: the context has not moved past it yet
            ctx.advance(index - 1, last.output_ids, [*ctx.ids, *last.output_ids, *self._observation_ids(msgs[:-1], last, prompt)])
        else:  # stopped after observations (turn or token limit): the prompt follows them
            ctx.advance(index - 1, [], self.client.render([*msgs, *prompt], self.tool_schemas).token_ids)
        msgs = [*msgs, *prompt]
        room = self.client.max_model_len - len(ctx.ids)
        sampling = SamplingParams(
            # a constrained answer must be allowed to finish: at least FINALIZE_MIN_TOKENS, whatever the per-turn cap
            max_new_tokens=max(1, min(max(self.config.max_tokens_per_turn, FINALIZE_MIN_TOKENS), room - 1)),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            logprobs=True,
            grammar=grammar,
        )
        res = await self.client.generate(ctx.ids, sampling, lease.adapter, f"{run_id}-final")
        calls = self.client.parse_tool_calls(res.text, set(self.client_tool_names)).tool_calls if kind == "tool" else []
        turn_id = new_id("turn")
        await self._record(res, ctx.ids, turn_id, lease, session_id, run_id, parent, index, msgs, calls, res.finish_reason, trajectory_id)
        step = StepRecord(index, turn_id, res.text, len(res.output_ids), res.finish_reason, decision="finalize")
        text = self.client.parse_tool_calls(res.text, set(self.client_tool_names)).content or "" if calls else res.text
        return _Final(res, step, text, calls)

    def _check_branch(self, branch: Branch, max_turns: int) -> None:
        if self.config.t2po.thinking_intervention or self.config.t2po.turn_resample:
            raise ValueError("branch: runs of agents with T²PO cannot be replayed exactly")
        if branch.turn >= max_turns:
            raise ValueError(f"branch: turn {branch.turn} is not below max_turns {max_turns}")
        end = len(branch.backbone) + (1 if branch.pending is not None else 0)  # a paused path continues at its end
        if not 0 <= branch.turn < end or [t.index for t in branch.backbone] != list(range(len(branch.backbone))):
            raise ValueError(f"branch: turn {branch.turn} is not one of the backbone's {len(branch.backbone)} turns")

    def _replayed(self, ids: Sequence[int], turn: Turn, rid: str) -> GenerateResult:
        """A recorded turn played back as the store holds it (output ids, text and logprobs as generated)."""
        out = tuple(turn.output_ids)
        lps = tuple(TokenLogprob(t, lp) for t, lp in zip(out, turn.logprobs, strict=True)) if len(turn.logprobs) == len(out) else ()
        finish: Literal["stop", "length"] = "length" if turn.finish_reason == "length" else "stop"
        return GenerateResult(request_id=rid, prompt_ids=tuple(ids), output_ids=out, text=turn.output_text, finish_reason=finish, logprobs=lps)

    def _replay_step(
        self, branch: Branch, turn: int, text: str, calls: Sequence[Any], env: Env | None, policy: StopPolicy,
        history: list[TurnView], max_turns: int, step: StepRecord,
    ) -> tuple[str | None, float]:  # fmt: skip
        """What follows a replayed turn, from the record: no tool runs again; an environment is stepped with the
        recorded output (its state must follow the backbone) and must answer what was recorded. Returns the stop
        reason if the run would end here (a backbone never ends before its branch turn, so the caller refuses it)
        and the environment's reward for the turn."""
        if turn + 1 < len(branch.backbone):
            recorded = branch.backbone[turn + 1].messages[len(branch.backbone[turn].messages) + 1 :]  # what came after this turn's reply
        else:  # the last turn of a paused path: what was recorded when it paused
            recorded = [dict(m) for m in branch.pending or ()]
        step.observation = "\n\n".join(str(m.get("content") or "") for m in recorded) or None
        history.append(TurnView(text=text, tool_calls=len(calls)))
        if env is not None and not calls:
            env_step = env.step(text)
            if env_step.done:
                return "env_done", env_step.reward
            if recorded[-1:] != [{"role": "user", "content": env_step.observation}]:
                raise BranchMismatch(
                    f"branch of {branch.of or 'a trajectory'} at turn {turn}: the environment's replay differs from the recorded one"
                )
            return None, env_step.reward
        if calls:
            return None, 0.0
        decision = policy.decide(history, max_turns)
        step.decision = decision.reason
        return (decision.reason if decision.stop else None), 0.0

    async def _generate(
        self, ids: Sequence[int], sampling: SamplingParams, lease: Lease, rid: str, policy: StopPolicy
    ) -> tuple[GenerateResult, bool, list[int] | None]:
        """One turn's model output: (result, whether T²PO intervened, loss mask or None for all-ones).

        With the thinking intervention on, the call is streamed under the monitor; when it fires, the thinking is
        cut, the intervention text is appended as forced tokens and decoding continues in the same turn (a second
        engine call on context + thinking + forced tokens). The turn's output is thinking + forced + answer, the
        forced tokens masked out of training (loss mask 0, logprob 0): an intervention does not use up a turn."""
        t2 = self.config.t2po
        if not t2.thinking_intervention:
            return await self.client.generate(ids, sampling, lease.adapter, rid), False, None
        monitor = t2.new_monitor()
        out_ids: list[int] = []
        lps: list[TokenLogprob] = []
        text = ""
        finish = None
        timings = Timings()
        tok = self.client.tokenizer
        stream = self.client.stream(ids, sampling, lease.adapter, rid)
        try:
            async for chunk in stream:
                before, got = text, chunk.token_ids
                out_ids += got
                lps += chunk.logprobs
                text += chunk.text
                timings = chunk.timings or timings
                finish = chunk.finish_reason
                if finish is None and len(chunk.logprobs) == len(got):  # token by token: the cut is not at the chunk's end
                    thinking = thinking_tokens(before, chunk.text, got, lambda head: str(tok.decode(list(head), skip_special_tokens=True)))
                    at = chunk_cut(monitor, [(lp.logprob, lp.top) for lp in chunk.logprobs], thinking)
                    if at is not None:
                        if at < len(got) - 1:  # keep the chunk's tokens up to the one the monitor fired at
                            keep = len(out_ids) - len(got) + at + 1
                            out_ids, lps = out_ids[:keep], lps[:keep]
                            text = tok.decode(out_ids, skip_special_tokens=True)
                        break
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        first = GenerateResult(
            request_id=rid,
            prompt_ids=tuple(ids),
            output_ids=tuple(out_ids),
            text=text,
            finish_reason=finish or "abort",
            logprobs=tuple(lps),
            timings=timings,
        )
        if finish is not None:
            return first, False, None
        forced_text = intervention_text(_action_tag(policy))
        forced_ids = list(self.client.tokenizer.encode(forced_text, add_special_tokens=False))
        left = sampling.max_new_tokens - len(out_ids) - len(forced_ids)
        room = self.client.max_model_len - len(ids) - len(out_ids) - len(forced_ids)
        if left < 1 or room < 2:  # no room for an answer after the cut: the turn ends at the cut thinking
            return first, True, None
        cont_sampling = replace(sampling, max_new_tokens=min(left, room - 1), grammar=None)
        rest = await self.client.generate([*ids, *out_ids, *forced_ids], cont_sampling, lease.adapter, f"{rid}-answer")
        merged = GenerateResult(
            request_id=rid,
            prompt_ids=tuple(ids),
            output_ids=(*out_ids, *forced_ids, *rest.output_ids),
            text=text + forced_text + rest.text,
            finish_reason=rest.finish_reason,
            logprobs=(*lps, *(TokenLogprob(t, 0.0) for t in forced_ids), *rest.logprobs),
            timings=Timings(timings.queued_s, timings.ttft_s, timings.total_s + rest.timings.total_s),
        )
        mask = [1] * len(out_ids) + [0] * len(forced_ids) + [1] * len(rest.output_ids)
        return merged, True, mask

    def _observation_ids(self, msgs: list[dict[str, Any]], res: GenerateResult, observations: list[dict[str, Any]]) -> list[int]:
        """The template's tokens between the end of the model's output and the next generation prompt."""
        rendered = self.client.render([*msgs, {"role": "assistant", "content": SENTINEL}, *observations], self.tool_schemas).text
        at = rendered.rfind(SENTINEL)
        if at < 0:
            raise RuntimeError("the chat template dropped the assistant message; cannot build observation tokens")
        rest = rendered[at + len(SENTINEL) :]
        last = res.output_ids[-1] if res.output_ids else None
        if last is not None and last in self.client.eos_token_ids:
            end = self.client.tokenizer.decode([last])
            if rest.startswith(end):
                rest = rest[len(end) :]  # the model already produced the end-of-turn token
        return list(self.client.tokenizer.encode(rest, add_special_tokens=False))

    def _turn(
        self, res: GenerateResult, ctx_ids: Sequence[int], turn_id: str, lease: Lease, session_id: str, run_id: str, parent: str | None,
        index: int, msgs: list[dict[str, Any]], calls: Sequence[Any], finish: str, trajectory_id: str, grammar: Grammar | None = None,
        mask: list[int] | None = None, check: TurnCheck | None = None,
    ) -> Turn:  # fmt: skip
        sampling: dict[str, Any] = {"temperature": self.config.temperature, "top_p": self.config.top_p, "agent": self.config.name}
        if grammar is not None:  # the learner re-applies it, so its logprobs are of the distribution that was sampled
            sampling["grammar"] = {"kind": grammar.kind, "spec": grammar.spec}
        return Turn(
            turn_id=turn_id,
            trajectory_id=trajectory_id,
            session_id=session_id,
            index=index,
            parent_turn_id=parent,
            completion_id=run_id,
            model=self.config.name,
            adapter=lease.adapter,
            context_ids=list(ctx_ids),
            output_ids=list(res.output_ids),
            logprobs=[lp.logprob for lp in res.logprobs],
            loss_mask=list(mask) if mask is not None else [1] * len(res.output_ids),
            sampling=sampling,
            tool_calls=[ToolCallRecord(id=c.id, name=c.name, arguments=c.arguments) for c in calls],
            finish_reason=finish,
            timings=TurnTimings(queued_s=res.timings.queued_s, ttft_s=res.timings.ttft_s, total_s=res.timings.total_s),
            messages=[dict(m) for m in msgs],
            output_text=res.text,
            self_check=check,
        )

    async def _record(self, res: GenerateResult, ctx_ids: Sequence[int], turn_id: str, lease: Lease, session_id: str, run_id: str,
                      parent: str | None, index: int, msgs: list[dict[str, Any]], calls: Sequence[Any], finish: str,
                      trajectory_id: str, grammar: Grammar | None = None, mask: list[int] | None = None,
                      check: TurnCheck | None = None) -> None:  # fmt: skip
        turn = self._turn(res, ctx_ids, turn_id, lease, session_id, run_id, parent, index, msgs, calls, finish, trajectory_id, grammar, mask, check)
        await self.client.record([turn])

    async def _record_draft(self, res: GenerateResult, ctx_ids: Sequence[int], lease: Lease, session_id: str, run_id: str, parent: str | None,
                            index: int, msgs: list[dict[str, Any]], grammar: Grammar | None = None) -> None:  # fmt: skip
        """A discarded T²PO draft: its own branch trajectory off the previous turn, marked as a draft."""
        draft_traj = new_id("traj")
        turn = self._turn(res, ctx_ids, new_id("turn"), lease, session_id, run_id, parent, index, msgs, [], res.finish_reason, draft_traj, grammar)
        await self.client.record([turn])
        await self.client.annotate(draft_traj, {"agent": self.config.name, "resampled_draft": True, "run_id": run_id, "trainable": True})

    async def _finish(self, result: RunResult) -> None:
        if not result.steps or not self.client.recording:
            return
        meta = {
            "agent": result.agent,
            "run_id": result.run_id,
            "stop_reason": result.stop_reason,
            "turns": result.turns,
            "trainable": result.trainable,
            "broken_at": result.broken_at,
            "drift_turns": result.drift_turns,
            "format_failures": result.format_failures,
            "t2po": result.t2po,
            "task": result.task,
            "task_key": result.task_key,
            "problem_id": result.problem_id,
            "p_correct": result.p_correct,
            "correct": result.correct,
            "score": result.score if result.score is not None else result.reward,
            "eval": result.eval,
            "problem_index": result.problem_index,
            "problem_seed": result.problem_seed,
        }
        if result.state_keys:
            meta["state_keys"] = result.state_keys
        if result.group is not None:
            meta["group"] = result.group
        if result.horizon is not None:
            meta["horizon"] = result.horizon
        if result.branch_of is not None or result.rerollout is not None:
            meta.update(branch_of=result.branch_of, branch_turn=result.branch_turn, anchor=result.anchor, rerollout=result.rerollout)
        if result.patr_tree is not None:  # a PATR segment: never in the live sample stream (the tree's update trains on it)
            meta.update(rerollout="patr", patr_tree=result.patr_tree, paused=result.stop_reason == "paused", prefix_score=result.prefix_score)
            if result.pending is not None:
                meta["pending"] = result.pending
        await self.client.annotate(result.trajectory_id, meta)
        if result.reward is not None and result.task is not None:
            await self.client.reward(
                Reward(
                    target="trajectory",
                    target_id=result.trajectory_id,
                    value=result.reward,
                    source=f"verifier:{result.task}",
                    comment=result.verdict_detail,
                )
            )


def _turn_uncertainty(lps: Sequence[TokenLogprob], mask: Sequence[int] | None = None) -> float | None:
    """The turn's mean token uncertainty over its sampled tokens (forced tokens, mask 0, are not the model's)."""
    sampled = [lp for k, lp in enumerate(lps) if mask is None or mask[k]]
    if not sampled:
        return None
    return turn_uncertainty([token_uncertainty(lp.logprob, lp.top) for lp in sampled])


def _finite_number(x: Any) -> TypeGuard[int | float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _prefix_score(task: Task, problem: Problem, env: Env | None, texts: list[str], *, done: bool) -> float | None:
    """The task's process score of a run so far (``score_prefix``), clipped to [0, 1]; None if it has none."""
    from agents.tasks.base import PrefixState

    fn = getattr(task, "score_prefix", None)
    score = fn(problem, PrefixState(env, tuple(texts), done)) if callable(fn) else None
    return min(1.0, max(0.0, float(score))) if _finite_number(score) else None


def _state_key(env: Env | None) -> str | None:
    """The environment's state key (``agents.tasks.base.Env``), if it has one."""
    fn = getattr(env, "state_key", None)
    key = fn() if callable(fn) else None
    return key if isinstance(key, str) and key else None


def _action_tag(policy: StopPolicy) -> str | None:
    return {"svr": "solution", "svr_r1": "answer"}.get(policy.fmt)
