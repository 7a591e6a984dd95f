"""The agent loop over a scripted engine with the real tiny tokenizer, formatter, recorder and SQLite store.

What is checked: the prefix invariant over a five-turn tool conversation (each context = previous
context + output + observation, observation tokens never in any output), tool errors returned as
observations, a context rewrite marking the trajectory untrainable, the stop policies driving the loop,
verifier rewards attached to the trajectory, and T²PO's intervention and resampling with their counts.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.loop import AgentLoop
from agents.run_state import ContextTracker
from agents.tasks import Problem, TaskBase, get_task
from tests.agents._scripted import Reply, ScriptedEngine, make_client
from tools.builtins import default_registry


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def call(expr: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"


def run(tok, tmp_path: Path, script, *, problem=None, task=None, rewrite=None, messages=None, **cfg):
    engine = ScriptedEngine(tok, script)
    client, recorder, store = make_client(tok, engine, tmp_path)
    config = AgentConfig(name="t-agent", **cfg)
    loop = AgentLoop(config, client, default_registry(), task=task, rewrite=rewrite)

    async def go():
        try:
            return await loop.run(messages or [{"role": "user", "content": "what is 2+3+4+5+6?"}], session_id="s1", problem=problem, seed=1)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    return result, engine, SqliteStoreView(tmp_path)


class SqliteStoreView:
    def __init__(self, path: Path) -> None:
        from learner.records.store import SqliteStore

        self.store = SqliteStore(path / "interactions.db")

    def trajectory(self, tid: str):
        return self.store.get_trajectory(tid)


def test_five_turn_tool_conversation_keeps_the_prefix_invariant(tok, tmp_path):
    script = [call("2+3"), call("5+4"), call("9+5"), call("14+6"), "The sum is <answer>20</answer>"]
    result, engine, view = run(tok, tmp_path, script, tools=("calculator",), max_turns=6)
    assert result.stop_reason == "final_answer" and result.answer == "20" and result.turns == 5
    assert result.trainable and result.broken_at is None
    assert [e.content for s in result.steps for e in s.tool_calls] == ["5", "9", "14", "20"]
    traj = view.trajectory(result.trajectory_id)
    turns = traj.turns
    assert [t.index for t in turns] == [0, 1, 2, 3, 4]
    assert [t.parent_turn_id for t in turns[1:]] == [t.turn_id for t in turns[:-1]]
    for prev, nxt in zip(turns, turns[1:]):
        head = prev.context_ids + prev.output_ids
        assert nxt.context_ids[: len(head)] == head  # the invariant, on the recorded ids
        obs = tok.decode(nxt.context_ids[len(head) :])
        assert "<tool_response>" in obs and obs.rstrip().endswith("<|im_start|>assistant")
        assert "<tool_response>" not in tok.decode(prev.output_ids)  # observations are never model output
    # every model call was a recorded turn with its exact engine context
    assert [list(c.input_ids) for c in engine.calls] == [t.context_ids for t in turns]
    assert all(t.loss_mask == [1] * len(t.output_ids) and t.adapter is None for t in turns)
    assert traj.meta["trainable"] is True and traj.meta["stop_reason"] == "final_answer" and traj.meta["agent"] == "t-agent"


def test_tool_errors_go_back_to_the_model(tok, tmp_path):
    bad = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expr": "1+1"}}) + "\n</tool_call>"
    script = [bad, call("1/0"), "<answer>2</answer>"]
    result, engine, _ = run(tok, tmp_path, script, tools=("calculator",))
    first, second = result.steps[0].tool_calls[0], result.steps[1].tool_calls[0]
    assert not first.ok and "expression" in first.content
    assert not second.ok and "zero" in second.content.lower()
    seen = tok.decode(engine.calls[2].input_ids)
    assert first.content in seen and second.content in seen
    assert result.answer == "2"


def test_a_context_rewrite_marks_the_trajectory_untrainable(tok, tmp_path):
    def rewrite(msgs, turn):
        if turn == 2:  # e.g. a memory copilot editing the system prompt mid-run
            return [{**msgs[0], "content": msgs[0]["content"] + "\nMemory: the user likes sums."}, *msgs[1:]]
        return None

    result, _, view = run(tok, tmp_path, [call("2+3"), call("5+4"), "<answer>9</answer>"], tools=("calculator",), rewrite=rewrite)
    assert not result.trainable and result.broken_at == 2
    traj = view.trajectory(result.trajectory_id)
    assert traj.meta["trainable"] is False and traj.meta["broken_at"] == 2
    samples = list(view.store.iter_samples())
    assert samples and not any(s["trainable"] for s in samples)


def test_svr_refines_until_verified(tok, tmp_path):
    script = [
        "<solution>2+3=6</solution><verdict>Incorrect</verdict><confidence>0.8</confidence>",
        "<solution>2+3=5</solution><verdict>Correct</verdict><confidence>0.6</confidence>",
        "<solution>2+3=5. The answer is 5.</solution><verdict>Correct</verdict><confidence>0.9</confidence>",
        "never reached",
    ]
    result, engine, _ = run(tok, tmp_path, script, stop_policy="svr", stop_params={"tau": 0.7}, max_turns=6)
    assert result.stop_reason == "verified" and result.turns == 3 and len(engine.calls) == 3
    assert result.answer == "2+3=5. The answer is 5." and result.p_correct == pytest.approx(0.9)
    assert [s.decision for s in result.steps] == ["continue_refine", "continue_refine", "verified"]
    assert "Incorrect" in tok.decode(engine.calls[1].input_ids[len(engine.calls[0].input_ids) :])  # feedback from its own check
    assert "<verdict>Correct or Incorrect</verdict>" in tok.decode(engine.calls[0].input_ids)  # the format is taught in the system prompt


def test_svr_returns_the_best_self_rated_answer_at_the_cap(tok, tmp_path):
    script = [
        "<solution>A 7</solution><verdict>Correct</verdict><confidence>0.5</confidence>",
        "garbage without tags",
        "<solution>B 8</solution><verdict>Correct</verdict><confidence>0.6</confidence>",
    ]
    result, _, _ = run(tok, tmp_path, script, stop_policy="svr", max_turns=3)
    assert result.stop_reason == "max_turns_best" and result.answer == "B 8"
    assert result.format_failures == 1 and result.steps[1].format_failure


def test_fixed_policy_runs_to_the_cap(tok, tmp_path):
    result, engine, _ = run(tok, tmp_path, ["<answer>1</answer>", "<answer>2</answer>", "<answer>3</answer>"], stop_policy="fixed", max_turns=3)
    assert result.turns == 3 and result.answer == "3" and result.stop_reason == "max_turns"


def test_verifier_reward_is_attached_to_the_trajectory(tok, tmp_path):
    task = get_task("basic_arithmetic")
    problem = task.problems(1, seed=5)[0]
    result, _, view = run(tok, tmp_path, [f"<answer>{problem.answer}</answer>"], task=task, problem=problem)
    assert result.reward == 1.0 and result.correct
    traj = view.trajectory(result.trajectory_id)
    [reward] = [r for r in traj.rewards if r.target == "trajectory"]
    assert reward.value == 1.0 and reward.source == "verifier:basic_arithmetic"
    assert traj.meta["task_key"] == task.task_key(problem)
    wrong, _, view2 = run(tok, tmp_path / "w", ["<answer>-123456789</answer>"], task=task, problem=problem)
    assert wrong.reward == 0.0 and not wrong.correct


def test_frozenlake_runs_as_a_multi_turn_environment(tok, tmp_path):
    task = get_task("frozenlake")
    problem = task.problems(1, seed=0)[0]
    moves = problem.metadata.get("solution") or problem.answer
    assert moves, "the frozenlake problem should carry a shortest solution"
    script = [f"<action>{m}</action>" for m in _move_words(moves)] + ["<action>left</action>"] * 20
    result, _, _ = run(tok, tmp_path, script, task=task, problem=problem, max_turns=30, messages=[{"role": "user", "content": problem.prompt}])
    assert result.stop_reason == "env_done" and result.reward == 1.0 and result.correct


def test_environment_state_keys_are_recorded_for_gigpo(tok, tmp_path):
    # a move into the edge leaves the agent where it was: turns 0 and 1 act in one state, with different histories
    task = get_task("frozenlake")
    problem = task.problems(1, seed=0)[0]
    moves = problem.metadata.get("solution") or problem.answer
    script = ["<action>left</action>"] + [f"<action>{m}</action>" for m in _move_words(moves)]
    result, _, view = run(tok, tmp_path, script, task=task, problem=problem, max_turns=30, messages=[{"role": "user", "content": problem.prompt}])
    assert result.correct and len(result.state_keys) == result.turns
    assert result.state_keys[0] == result.state_keys[1] == "cell:0,0" and len(set(result.state_keys)) == result.turns - 1
    traj = view.trajectory(result.trajectory_id)
    assert traj.meta["state_keys"] == result.state_keys
    from learner.config import SampleConfig
    from learner.samples import SkipCounts, trajectory_samples

    ts = [s.to_turn_sample() for s in trajectory_samples(traj, family="f", min_version=0, cfg=SampleConfig(), counts=SkipCounts())]
    assert ts[0].state == ts[1].state and ts[0].anchor != ts[1].anchor  # same state, different exact contexts


def _move_words(moves) -> list[str]:
    names = {"L": "left", "D": "down", "R": "right", "U": "up"}
    if isinstance(moves, str):
        return [names.get(c, c) for c in moves if c.strip()]
    return [names.get(str(m), str(m)) for m in moves]


def test_t2po_turn_resampling_regenerates_flat_turns(tok, tmp_path):
    # turn 0 sets the baseline; turn 1's uncertainty barely moves (0 < Δ < η) → regenerated up to max_try
    script = [Reply(call("1+1"), p=0.7), Reply(call("2+2"), p=0.71), Reply(call("2+2"), p=0.72), Reply("<answer>4</answer>", p=0.99)]
    t2 = {"turn_resample": True, "eta": 0.3, "max_try": 1, "top_logprobs": 2}
    result, engine, view = run(tok, tmp_path, script, tools=("calculator",), t2po=t2)
    assert result.t2po["resamples"] == 1 and result.steps[1].drafts_discarded == 1
    assert len(engine.calls) == 4 and result.turns == 3
    drafts = [t for t in view.store.list_trajectories() if t["meta"].get("resampled_draft")]
    assert len(drafts) == 1


def test_t2po_thinking_intervention_cuts_a_plateaued_think_span_within_the_turn(tok, tmp_path):
    thinking = "<think>" + " hmm" * 200
    script = [Reply(thinking, p=0.5, eos=False), Reply("<answer>5</answer>", p=0.9)]
    t2 = {"thinking_intervention": True, "window": 4, "threshold": 0.05, "min_tokens": 8, "think_budget": None, "top_logprobs": 2}
    # max_turns 1: the intervention must not use up the turn (it used to end the run with an empty answer, and the
    # cut thinking was trained as a turn of its own with reward 0)
    result, engine, view = run(tok, tmp_path, script, t2po=t2, max_tokens_per_turn=512, max_turns=1)
    assert result.t2po["interventions"] == 1 and result.steps[0].intervened
    assert result.turns == 1 and result.answer == "5" and result.stop_reason == "final_answer"
    second = tok.decode(engine.calls[1].input_ids[len(engine.calls[0].input_ids) :])
    assert second.endswith("</think>\n")  # the answer is decoded after the forced close
    [turn] = view.trajectory(result.trajectory_id).turns
    forced = tok.encode("\n</think>\n", add_special_tokens=False)
    n_think = len(turn.output_ids) - len(forced) - len(tok.encode("<answer>5</answer>", add_special_tokens=False)) - 1  # - eos
    assert n_think < 200  # cut early, not at the end of the span
    assert turn.output_ids[n_think : n_think + len(forced)] == forced
    assert turn.loss_mask == [1] * n_think + [0] * len(forced) + [1] * (len(turn.output_ids) - n_think - len(forced))
    assert turn.logprobs[n_think : n_think + len(forced)] == [0.0] * len(forced)  # not sampled: masked out of training
    assert turn.finish_reason == "stop" and view.trajectory(result.trajectory_id).meta["t2po"]["interventions"] == 1


def test_t2po_turn_resampling_keeps_the_grammar_of_a_constrained_agent(tok, tmp_path):
    # an svr agent decodes under its format grammar; a regenerated turn must get the same Grammar (rebuilding the
    # sampling params through asdict turned it into a dict, which the engines cannot compile)
    fmt = "<think>x</think><solution>\\boxed{{{a}}}</solution><verdict>Incorrect</verdict><confidence>0.5</confidence>"
    script = [Reply(fmt.format(a=1), p=0.7), Reply(fmt.format(a=2), p=0.71), Reply(fmt.format(a=3), p=0.72), Reply(fmt.format(a=4), p=0.99)]
    t2 = {"turn_resample": True, "eta": 0.3, "max_try": 1, "top_logprobs": 2}
    result, engine, view = run(tok, tmp_path, script, stop_policy="svr", max_turns=3, t2po=t2)
    assert result.t2po["resamples"] == 1 and result.steps[1].drafts_discarded == 1
    grammars = [c.sampling.grammar for c in engine.calls]
    assert grammars[0] is not None and all(g == grammars[0] for g in grammars)  # same Grammar, drafts included
    # and the recorded turns carry it, so the learner scores them under the same mask
    traj = view.trajectory(result.trajectory_id)
    assert traj.turns[0].sampling["grammar"] == {"kind": grammars[0].kind, "spec": grammars[0].spec}


def test_context_tracker_detects_a_broken_prefix():
    ctx = ContextTracker([1, 2, 3])
    ctx.advance(0, [4], [1, 2, 3, 4, 5])
    assert ctx.intact
    ctx.advance(1, [6], [1, 2, 9, 4, 5, 6])
    assert not ctx.intact and ctx.broken_at == 2


def test_adapter_family_serves_the_base_until_a_champion_exists(tok, tmp_path):
    from runtime.adapters.names import AdapterRef

    engine = ScriptedEngine(tok, lambda req: "<answer>1</answer>")
    client, recorder, _ = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="fam-agent", adapter_family="fam"), client, default_registry())

    async def go():
        before = await loop.run([{"role": "user", "content": "x"}], session_id="s")
        await client.registry.register(AdapterRef("fam", 1, str(tmp_path)), make_alias=True)
        after = await loop.run([{"role": "user", "content": "x"}], session_id="s")
        pinned = await loop.run([{"role": "user", "content": "x"}], session_id="s", model="tiny")
        await recorder.flush()
        return before, after, pinned

    before, after, pinned = asyncio.run(go())
    recorder.close()
    assert before.adapter is None and after.adapter == "fam@1" and pinned.adapter is None
    assert [c.adapter for c in engine.calls] == [None, "fam@1", None]


def test_self_check_formats_are_decoded_under_a_grammar_unless_tools_are_on(tok, tmp_path):
    svr = "<solution>3 * 5 = 15. The answer is 15.</solution>\n<verdict>Correct</verdict>\n<confidence>0.95</confidence>"
    result, engine, _ = run(tok, tmp_path / "a", [svr], stop_policy="svr")
    grammar = engine.calls[0].sampling.grammar
    assert grammar is not None and grammar.kind == "ebnf" and '"<solution>"' in grammar.spec
    assert result.stop_reason == "verified"
    _, engine2, _ = run(tok, tmp_path / "b", [svr], stop_policy="svr", tools=("calculator",))
    assert engine2.calls[0].sampling.grammar is None  # tool calls must stay possible
    _, engine3, _ = run(tok, tmp_path / "c", [svr], stop_policy="svr", constrain_format=False)
    assert engine3.calls[0].sampling.grammar is None


@pytest.mark.parametrize("fmt", ["svr", "svr_r1"])
def test_every_sentence_of_the_format_grammar_parses(tok, fmt):
    import xgrammar as xgr

    from agents.prompts import format_grammar
    from agents.stop import parse_turn

    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok)).compile_grammar(format_grammar(fmt)))
    text = (
        "<solution>2 + 2 = 4</solution>\n<verdict>Incorrect</verdict>\n<confidence>0.35</confidence>"
        if fmt == "svr"
        else "<answer>4</answer>\n<verify>No</verify>"
    )
    assert matcher.accept_string(text)  # the example is a sentence of the grammar
    check = parse_turn(text, fmt)
    assert check is not None and check.format_ok and check.verdict == "incorrect"
    bad = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok)).compile_grammar(format_grammar(fmt)))
    assert not bad.accept_string("The answer is 42.")


class _OutcomeEnv:
    """Ends after two steps; the last step reports its own outcome (as the kernel task does)."""

    def __init__(self, info: dict) -> None:
        self.info, self.n = info, 0

    def reset(self) -> str:
        return "go"

    def step(self, action_text: str):
        from agents.tasks import EnvStep

        self.n += 1
        return EnvStep("again", 0.0, False) if self.n < 2 else EnvStep("done", 1.0, True, info=self.info)


class _OutcomeTask(TaskBase):
    name, description = "outcome", "an env task whose last step reports correct and an uncapped score"

    def __init__(self, info: dict) -> None:
        self.info = info

    def problems(self, n: int, seed: int = 0):
        return [Problem(self.name, f"o/{i}", "play", None, {}) for i in range(n)]

    def make_env(self, problem):
        return _OutcomeEnv(self.info)


@pytest.mark.parametrize(
    "info,reward,correct",
    [
        ({}, 1.0, True),
        ({"correct": True, "score": 2.7}, 2.7, True),
        ({"correct": False, "score": 0.0}, 0.0, False),
        ({"score": float("nan")}, 1.0, True),
    ],
)
def test_an_environment_can_report_its_own_outcome(tok, tmp_path, info, reward, correct):
    task = _OutcomeTask(info)
    result, _, view = run(tok, tmp_path, ["a", "b"], task=task, problem=task.problems(1)[0], max_turns=5)
    assert result.stop_reason == "env_done" and result.reward == reward and result.correct is correct
    meta = view.trajectory(result.trajectory_id).meta
    assert meta["score"] == reward and meta["correct"] is correct  # what LEAP's rank estimator reads


def test_tcpo_verifier_feedback_mode_shows_the_score_between_turns(tok, tmp_path):
    task = get_task("feedback:calc_arith", n_ops=1, use_tools=False)
    problem = task.problems(1, seed=0)[0]
    assert task.name == "feedback:calc_arith" and task.task_key(problem) == get_task("calc_arith", n_ops=1).task_key(problem)
    right = int(problem.answer)
    script = [f"<answer>{right + 1}</answer>", f"<answer>{right}</answer>", "unused"]
    result, engine, view = run(tok, tmp_path, script, task=task, problem=problem, max_turns=3, messages=[{"role": "user", "content": problem.prompt}])
    assert result.turns == 2 and result.correct and result.reward == 1.0 and result.stop_reason == "env_done"
    assert "score 0.00" in result.steps[0].observation and "Try again" in result.steps[0].observation
    shown = tok.decode(engine.calls[1].input_ids[len(engine.calls[0].input_ids) :])
    assert "The verifier checked your answer" in shown  # the score is in the next turn's context
    traj = view.trajectory(result.trajectory_id)
    turn_scores = {r.target_id: r.value for r in traj.rewards if r.target == "turn"}
    assert [turn_scores[t.turn_id] for t in traj.turns] == [0.0, 1.0]  # TCPO's v_t, per turn
    with pytest.raises(ValueError, match="nested"):
        get_task("feedback:feedback:calc_arith")


class _ThreadNotingEnv(_OutcomeEnv):
    """Notes the thread its reset and steps run on (a sandboxed check or a kernel compile blocks it for seconds)."""

    def __init__(self, info: dict, threads: list[str]) -> None:
        super().__init__(info)
        self.threads = threads

    def reset(self) -> str:
        self.threads.append(threading.current_thread().name)
        return super().reset()

    def step(self, action_text: str):
        self.threads.append(threading.current_thread().name)
        return super().step(action_text)


class _ThreadNotingTask(_OutcomeTask):
    def __init__(self) -> None:
        super().__init__({})
        self.threads: list[str] = []

    def make_env(self, problem):
        self.threads.append(threading.current_thread().name)
        return _ThreadNotingEnv(self.info, self.threads)

    def process_score(self, problem, text):
        self.threads.append(threading.current_thread().name)
        return None


def test_the_tasks_own_code_runs_off_the_event_loop(tok, tmp_path):
    """A task's environment, process score and verdict ran on the event loop: a HumanEval check (a sandboxed program,
    seconds) or a kernel compile (minutes) froze every other request of the server meanwhile."""
    task = _ThreadNotingTask()
    result, _, _ = run(tok, tmp_path, ["a", "b"], task=task, problem=task.problems(1)[0], max_turns=5)
    assert result.stop_reason == "env_done" and result.reward == 1.0
    # make_env, reset, then per turn a process score and a step: all of them on the task pool, none on the loop's thread
    assert len(task.threads) == 6 and all(name.startswith("loopwise-task") for name in task.threads), task.threads
