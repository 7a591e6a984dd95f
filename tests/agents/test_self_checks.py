"""Per-turn self-checks on the record and fixed-horizon training runs (scripted engine, real tokenizer, recorder, SQLite).

Checked: each SVR / SVR-R1 turn is stored with its parsed solution, verdict, confidence and the verifier's
judgment of that solution (also for unparsable turns), plain-format turns carry none; a fixed-horizon run of
the SVR agent never stops before its horizon while the adaptive agent stops on the same first reply, with
the same first context (same system prompt) and the meta ``horizon`` that tells the learner it is a training run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agents.config import AgentConfig
from agents.host import RunRequest
from agents.loop import AgentLoop
from agents.self_checks import turn_check
from agents.tasks import get_task
from learner.records.store import SqliteStore
from tests.agents._scripted import ScriptedEngine, make_client
from tools.builtins import default_registry


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


TASK = get_task("basic_arithmetic")
PROBLEM = TASK.problems(1, seed=5)[0]
RIGHT, WRONG = str(PROBLEM.answer), str(int(PROBLEM.answer) + 1)


def svr(answer: str, verdict: str, conf: str) -> str:
    return f"<solution>{answer}</solution>\n<verdict>{verdict}</verdict>\n<confidence>{conf}</confidence>"


def run(tok, tmp_path: Path, script, *, horizon=None, **cfg):
    engine = ScriptedEngine(tok, script)
    client, recorder, _ = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="svr-t", constrain_format=False, **cfg), client, default_registry(), task=TASK)

    async def go():
        try:
            return await loop.run([{"role": "user", "content": PROBLEM.prompt}], session_id="s1", problem=PROBLEM, seed=1, horizon=horizon)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    store = SqliteStore(tmp_path / "interactions.db")
    traj = store.get_trajectory(result.trajectory_id)
    store.close()
    return result, engine, traj


def test_svr_turns_are_stored_with_their_check_and_the_verifiers_correctness(tok, tmp_path):
    script = [svr(WRONG, "Correct", "0.6"), "no tags at all", svr(RIGHT, "Incorrect", "0.3"), svr(RIGHT, "Correct", "0.95")]
    result, _, traj = run(tok, tmp_path, script, stop_policy="svr", stop_params={"tau": 0.7}, max_turns=6)
    assert result.turns == 4 and result.stop_reason == "verified"
    checks = [t.self_check for t in traj.turns]
    assert [(c.solution, c.verdict, c.confidence, c.format_ok, c.correct) for c in checks] == [
        (WRONG, "correct", 0.6, True, False),
        ("no tags at all", None, None, False, False),  # unparsable: the extracted text, verified like the policy's answer
        (RIGHT, "incorrect", 0.3, True, True),
        (RIGHT, "correct", 0.95, True, True),
    ]
    assert checks[1].error is not None and "missing <solution>" in checks[1].error
    assert [c.p_correct for c in checks] == [0.6, None, pytest.approx(0.7), 0.95]
    assert [s.correct for s in result.steps] == [False, False, True, True]  # the runs endpoint reports it too


def test_svr_r1_turns_carry_yes_no_and_plain_turns_carry_nothing(tok, tmp_path):
    script = [f"<answer>{WRONG}</answer>\n<verify>No</verify>", f"<answer>{RIGHT}</answer>\n<verify>Yes</verify>"]
    _, _, traj = run(tok, tmp_path, script, stop_policy="svr_r1")
    assert [(t.self_check.verdict, t.self_check.correct, t.self_check.format) for t in traj.turns] == [
        ("incorrect", False, "svr_r1"),
        ("correct", True, "svr_r1"),
    ]
    _, _, plain = run(tok, tmp_path / "plain", [f"<answer>{RIGHT}</answer>"], stop_policy="answer")
    assert [t.self_check for t in plain.turns] == [None]
    assert turn_check("svr", svr(RIGHT, "Correct", "0.9"), tool_calls=1, task=TASK, problem=PROBLEM) is None  # a tool turn is an action
    assert turn_check("svr", svr(RIGHT, "Correct", "0.9")).correct is None  # no task problem: not measured, never "wrong"


def test_fixed_horizon_run_never_stops_early_while_the_inference_agent_does(tok, tmp_path):
    confident_right = svr(RIGHT, "Correct", "0.95")  # the adaptive agent's stop condition from the first turn on
    adaptive, a_engine, a_traj = run(tok, tmp_path / "a", [confident_right] * 4, stop_policy="svr", stop_params={"tau": 0.7}, max_turns=4)
    assert adaptive.turns == 1 and adaptive.stop_reason == "verified" and "horizon" not in a_traj.meta

    fixed, f_engine, f_traj = run(tok, tmp_path / "f", [confident_right] * 4, stop_policy="svr", stop_params={"tau": 0.7}, max_turns=2, horizon=4)
    assert fixed.turns == 4 and len(f_engine.calls) == 4 and fixed.stop_reason == "max_turns"  # the horizon, not max_turns, bounds it
    assert f_traj.meta["horizon"] == 4 and fixed.correct and fixed.answer == RIGHT
    assert f_engine.calls[0].input_ids == a_engine.calls[0].input_ids  # the same system prompt and format: only the stop rule differs
    later = tok.decode(f_engine.calls[1].input_ids[len(f_engine.calls[0].input_ids) :])
    assert "You judged your solution Correct with confidence 0.95. Check it once more." in later  # not "only 0.95 (0.7 is needed)"
    assert [t.self_check.correct for t in f_traj.turns] == [True] * 4


def test_runs_endpoint_takes_a_horizon():
    assert RunRequest.model_validate({"input": "x", "horizon": 3}).horizon == 3
    with pytest.raises(ValueError):
        RunRequest.model_validate({"input": "x", "horizon": 0})
