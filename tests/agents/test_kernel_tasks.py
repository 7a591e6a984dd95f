"""The ``kernels`` task: task definitions and solutions, the multi-turn Env, rewards, and the kernel agent's loop.

CPU tests: every reference module imports and runs on CPU tensors; every solution follows the candidate
convention and takes exactly the model's inputs + parameters + buffers; the Env and ``verify`` on real
``tools.cuda`` compiles (one real solution, module-scoped, plus include-typo candidates that nvcc rejects in
its preprocessing pass within seconds) and on results built from the tools' own result types for the GPU
paths (correct / incorrect / benchmarked); the kernel agent's loop with the tiny tokenizer and a scripted
engine. The two tests that need a full real compile are marked ``slow`` (``-m "not slow"`` skips them).
GPU tests (``-m gpu``): every solution passes ``cuda_check`` and a deliberately wrong kernel fails.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents.tasks import get_task
from agents.tasks.kernels import CONVENTION, get_kernel_task, kernel_tasks
from agents.tasks.kernels.task import KernelTask, KernelToolset, extract_cuda, kevin_reward

ROOT = Path(__file__).resolve().parents[2]
SPECS = kernel_tasks()

# ---- task definitions and solutions --------------------------------------------------------------------


def test_there_are_at_least_30_tasks_over_three_levels():
    assert len(SPECS) >= 30
    per_level = {lvl: len(kernel_tasks(lvl)) for lvl in (1, 2, 3)}
    assert all(n >= 8 for n in per_level.values()), per_level
    assert len({s.name for s in SPECS}) == len(SPECS)
    assert get_kernel_task("softmax").name == "level2/softmax" and get_kernel_task("level1/relu").level == 1
    with pytest.raises(KeyError):
        get_kernel_task("nope")
    with pytest.raises(ValueError):
        kernel_tasks(4)


def test_importing_the_package_is_cheap():
    code = "import sys, agents.tasks.kernels as k; k.kernel_tasks(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _model_and_inputs(spec, seed: int = 0):
    mod = importlib.import_module(spec.module)
    torch.manual_seed(seed)
    model = mod.Model(*mod.get_init_inputs())
    return model, mod.get_inputs()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_reference_model_runs_on_cpu(spec):
    model, inputs = _model_and_inputs(spec)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in inputs)
    assert all(t.dtype == torch.float32 for t in [*model.parameters(), *model.buffers()])
    with torch.no_grad():
        out = model(*inputs)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > 0
    assert torch.isfinite(out).all()
    # seeded: the same seed gives the same model and inputs (cuda_check relies on it)
    model2, inputs2 = _model_and_inputs(spec)
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


_FORWARD_RE = re.compile(r"torch::Tensor\s+forward\s*\(([^)]*)\)\s*\{")
_BIND_RE = re.compile(r"PYBIND11_MODULE\s*\(\s*TORCH_EXTENSION_NAME\s*,\s*m\s*\)\s*\{\s*m\.def\(\s*\"forward\"\s*,\s*&forward\s*\)\s*;\s*\}")


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_solution_follows_the_convention_and_takes_the_models_arguments(spec):
    src = spec.solution
    assert re.search(r"^#include <torch/extension\.h>$", src, re.MULTILINE)
    assert _BIND_RE.search(src), "binds forward with PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)"
    assert re.search(r"__global__\s+void\s+\w+", src) and "<<<" in src, "launches its own kernel"
    [params] = _FORWARD_RE.findall(src)
    n_tensor_args = len([p for p in params.split(",") if p.strip().startswith("torch::Tensor")])
    model, inputs = _model_and_inputs(spec)
    assert n_tensor_args == len(inputs) + len(list(model.parameters())) + len(list(model.buffers()))
    for banned in ("torch::matmul", "torch::mm(", "torch::softmax", "torch::relu", "at::matmul", ".matmul(", "torch::bmm"):
        assert banned not in src, f"the solution must compute with its own kernel, not {banned}"
    assert extract_cuda(f"Here it is:\n```cuda\n{src}```\n") == src


def test_extract_cuda_picks_the_last_cuda_block():
    assert extract_cuda("no code") is None
    assert extract_cuda("```python\nprint(1)\n```") is None
    assert extract_cuda("```cpp\nA\n```\ntext\n```c++\nB\n```") == "B\n"
    assert extract_cuda("```\n__global__ void k() {}\n```") == "__global__ void k() {}\n"  # untagged but CUDA
    assert extract_cuda("```cuda\nunclosed __global__") == "unclosed __global__"
    assert extract_cuda("```\njust text\n```") is None


def test_problems_are_seeded_and_filtered():
    task = get_task("kernels", level=3, reward="rank", max_turns=2)
    assert isinstance(task, KernelTask) and len(task.specs) == len(kernel_tasks(3))
    first = task.problems(4, seed=0)
    assert [p.metadata["spec"] for p in first] == [s.name for s in kernel_tasks(3)[:4]]
    assert [p.id for p in task.problems(4, seed=3)] == [p.id for p in task.problems(4, seed=3)]
    assert [p.id for p in task.problems(4, seed=3)] != [p.id for p in first]
    p = first[0]
    assert p.answer == kernel_tasks(3)[0].solution and p.answer not in p.prompt
    assert "class Model" in p.prompt and "PYBIND11_MODULE" in p.prompt and "```cuda" in p.prompt
    assert len(task.problems(1000)) == len(kernel_tasks(3))
    for bad in ({"reward": "speed"}, {"max_turns": 0}, {"level": 7}):
        with pytest.raises(ValueError):
            get_task("kernels", **bad)


# ---- rewards, Env and verify on the tools' result types --------------------------------------------------


def kevin_cases():
    return [(True, 1.5, 1.8), (True, None, 0.3), (False, 3.0, 0.0), (None, 3.0, 0.0), (True, 0.2, 0.5)]


@pytest.mark.parametrize(("correct", "speedup", "expected"), kevin_cases())
def test_kevin_reward(correct, speedup, expected):
    assert kevin_reward(correct, speedup) == pytest.approx(expected)


class Recorded:
    """Answers the three tools from the tools' own result types: the GPU outcomes a CPU machine cannot produce."""

    def __init__(self, compile_fn, *, correct: bool | None, speedup: float | None = None) -> None:
        from tools.cuda import BenchResult, CheckResult

        self.calls: list[str] = []
        self.compile_fn = compile_fn

        def check(source, reference, **kw):
            self.calls.append("check")
            return CheckResult(
                measured=True, reason="checked", compiled=True, correct=correct, max_abs_err=0.0 if correct else 0.25,
                diagnostics=[], elapsed_s=0.1, timed_out=False,
            )  # fmt: skip

        def bench(source, reference, **kw):
            self.calls.append("bench")
            return BenchResult(
                measured=True, reason="timed", kernel_ms=0.01, eager_ms=0.01 * (speedup or 1.0), speedup=speedup, correct=True,
                elapsed_s=0.1, timed_out=False,
            )  # fmt: skip

        def comp(source, **kw):
            self.calls.append("compile")
            return self.compile_fn(source, **kw)

        self.toolset = KernelToolset(compile=comp, check=check, bench=bench, device=lambda: (True, "recorded"))


def compiled_ok(source, **kw):
    from tools.cuda import CompileResult

    return CompileResult(ok=True, diagnostics=[], log="", elapsed_s=1.0, timed_out=False)


def test_env_episode_ends_when_correct_and_benchmarked_with_kevin_reward():
    rec = Recorded(compiled_ok, correct=True, speedup=2.5)
    task = KernelTask(level=1, reward="kevin", max_turns=3, toolset=rec.toolset)
    problem = task.problems(1)[0]
    env = task.make_env(problem)
    assert "3 attempts" in env.reset()
    step = env.step(f"```cuda\n{problem.answer}```")
    assert step.done and step.reward == 1.0  # 0.3 + 2.5, capped at 1 for the loop
    assert step.info["kevin_reward"] == pytest.approx(2.8) and step.info["correct"] and step.info["speedup"] == 2.5
    assert "speedup 2.50x" in step.observation and rec.calls == ["compile", "check", "bench"]
    verdict = task.verify(problem, f"```cuda\n{problem.answer}```")
    assert verdict.correct and verdict.reward == 1.0 and "kevin reward 2.8" in verdict.detail


def test_env_incorrect_kernel_gets_feedback_and_runs_to_max_turns():
    rec = Recorded(compiled_ok, correct=False)
    task = KernelTask(level=2, reward="rank", max_turns=2, toolset=rec.toolset)
    env = task.make_env(task.problems(1)[0])
    env.reset()
    first = env.step("```cuda\n__global__ void k() {}\n```")
    assert not first.done and first.reward == 0.0 and "output is wrong" in first.observation and "1 attempts left" in first.observation
    fmt = env.step("I think it is right.")
    assert fmt.done and fmt.reward == 0.0 and fmt.info["format_error"] and "```cuda" in fmt.observation
    assert env.step("again").observation == "The episode is over."
    assert rec.calls == ["compile", "check"]  # the format error compiled nothing


def test_rank_reward_is_correctness_and_leaves_speed_to_the_learner():
    rec = Recorded(compiled_ok, correct=True, speedup=0.5)
    task = KernelTask(level=1, reward="rank", toolset=rec.toolset)
    step = task.make_env(task.problems(1)[0]).step("```cuda\nx __global__\n```")
    assert step.done and step.reward == 1.0 and step.info["speedup"] == 0.5


# ---- real compiles (tools.cuda, nvcc on this machine) ----------------------------------------------------


class CachedCompile:
    """The real ``cuda_compile``, called once per distinct source (a torch-extension compile takes minutes here)."""

    def __init__(self) -> None:
        from tools.cuda import cuda_compile

        self.fn = cuda_compile
        self.results: dict[str, object] = {}
        self.real_calls = 0

    def __call__(self, source, **kw):
        if source not in self.results:
            self.real_calls += 1
            self.results[source] = self.fn(source, **kw)
        return self.results[source]


@pytest.fixture(scope="module")
def real_tools():
    """Real compile (cached), real check/bench and the real device probe: on this CPU machine they report 'not measured'."""
    from tools.cuda import cuda_bench, cuda_check, cuda_device_available

    cached = CachedCompile()
    return cached, KernelToolset(compile=cached, check=cuda_check, bench=cuda_bench, device=cuda_device_available)


@pytest.fixture(scope="module")
def relu_compiled(real_tools):
    """The known-good ReLU solution compiled for real, once for this module."""
    cached, _ = real_tools
    spec = get_kernel_task("level1/relu")
    result = cached(spec.solution, timeout_s=900.0)
    return spec, result


def typo_include(source: str) -> str:
    """A realistic slip nvcc rejects while preprocessing (seconds, not minutes): a misspelt header."""
    return source.replace("#include <torch/extension.h>", "#include <torch/extention.h>")


def test_env_observation_on_a_real_compile_failure(real_tools):
    _, toolset = real_tools
    task = KernelTask(level=1, max_turns=3, toolset=toolset)
    problem = next(p for p in task.problems(20) if p.metadata["spec"] == "level1/relu")
    env = task.make_env(problem)
    env.reset()
    step = env.step(f"Try this:\n```cuda\n{typo_include(problem.answer)}```")
    assert not step.done and step.reward == 0.0
    assert "Compilation failed" in step.observation and "line 2" in step.observation and "extention.h" in step.observation
    outcome = step.info["outcome"]
    assert outcome["failure_class"] == "compile_error" and outcome["first_error"].startswith("line 2: error:")
    verdict = task.verify(problem, f"```cuda\n{typo_include(problem.answer)}```")
    assert not verdict.correct and verdict.reward == 0.0 and "extention.h" in verdict.detail


@pytest.mark.torch_ext  # one real torch-extension compile (~250 s of CPU here), shared with the loop test
@pytest.mark.timeout(1800)
def test_real_solution_compiles_and_cpu_gives_no_correctness_credit(real_tools, relu_compiled):
    spec, result = relu_compiled
    assert result.ok, result.summary()
    _, toolset = real_tools
    task = KernelTask(level=1, reward="kevin", toolset=toolset)
    problem = next(p for p in task.problems(20) if p.metadata["spec"] == spec.name)
    available, _ = toolset.device()
    if available:
        pytest.skip("a GPU is present: the measured path is covered by the gpu tests")
    step = task.make_env(problem).step(f"```cuda\n{spec.solution}```")
    assert step.done and step.reward == 0.0 and step.info["correct"] is None and not step.info["measured"]
    assert "not measured on this machine" in step.observation and "Compiled OK" in step.observation
    verdict = task.verify(problem, f"```cuda\n{spec.solution}```")
    assert not verdict.correct and verdict.reward == 0.0 and "not measured" in verdict.detail


# ---- the kernel agent's loop with the tiny model's tokenizer ---------------------------------------------


def test_kernel_agent_is_built_in():
    from agents.config import BUILTIN_AGENTS, AgentConfig

    [cfg] = [AgentConfig(**a) for a in BUILTIN_AGENTS if a["name"] == "kernel-agent"]
    assert cfg.task == "kernels" and cfg.adapter_family == "kernel-lora" and cfg.max_turns >= 2
    assert CONVENTION in cfg.system_prompt and "PYBIND11_MODULE" in cfg.system_prompt


def run_kernel_agent(tiny_model_path, tmp_path, task, problem, script):
    """The built-in kernel-agent's loop over a scripted engine (real tiny tokenizer, client, recorder, store)."""
    from transformers import AutoTokenizer

    from agents.config import BUILTIN_AGENTS, AgentConfig
    from agents.loop import AgentLoop
    from tests.agents._scripted import ScriptedEngine, make_client
    from tools.builtins import default_registry

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    engine = ScriptedEngine(tok, script, max_model_len=16384)
    client, recorder, _store = make_client(tok, engine, tmp_path)
    [raw] = [a for a in BUILTIN_AGENTS if a["name"] == "kernel-agent"]
    loop = AgentLoop(AgentConfig(**raw), client, default_registry(), task=task)

    async def go():
        try:
            return await loop.run([{"role": "user", "content": problem.prompt}], session_id="s1", problem=problem, seed=0)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    return result, engine, tok


def test_kernel_agent_loop_runs_to_max_turns_on_compile_errors(tiny_model_path, tmp_path, real_tools):
    _, toolset = real_tools
    spec = get_kernel_task("level1/relu")
    task = KernelTask(level=1, max_turns=2, toolset=toolset)
    problem = next(p for p in task.problems(20) if p.metadata["spec"] == spec.name)
    other_typo = spec.solution.replace("#include <torch/extension.h>", "#include <torch/extensions.h>")
    script = [f"```cuda\n{typo_include(spec.solution)}```", f"```cuda\n{other_typo}```", "unused"]
    result, engine, tok = run_kernel_agent(tiny_model_path, tmp_path, task, problem, script)
    assert len(engine.calls) == 2 and result.stop_reason == "env_done" and result.reward == 0.0 and not result.correct
    assert "extention.h" in tok.decode(list(engine.calls[1].input_ids))  # turn 1's diagnostics are turn 2's context
    assert "extensions.h" in result.steps[1].observation and "last of 2 attempts" in result.steps[1].observation


@pytest.mark.torch_ext  # uses the module's real ReLU compile
@pytest.mark.timeout(1800)
def test_kernel_agent_loop_turns_diagnostics_into_the_next_observation(tiny_model_path, tmp_path, real_tools, relu_compiled):
    spec, _ = relu_compiled
    _, toolset = real_tools
    task = KernelTask(level=1, max_turns=3, toolset=toolset)
    problem = next(p for p in task.problems(20) if p.metadata["spec"] == spec.name)
    broken = f"First try:\n```cuda\n{typo_include(spec.solution)}```"
    fixed = f"Fixed the header:\n```cuda\n{spec.solution}```"
    result, engine, tok = run_kernel_agent(tiny_model_path, tmp_path, task, problem, [broken, fixed, "unused"])
    assert len(engine.calls) == 2 and result.turns == 2
    assert "Compilation failed" in result.steps[0].observation and "extention.h" in result.steps[0].observation
    second_prompt = tok.decode(list(engine.calls[1].input_ids))
    assert "Compilation failed" in second_prompt and "line 2" in second_prompt  # the diagnostics reached the model
    assert result.stop_reason == "env_done" and result.trainable
    if not toolset.device()[0]:
        assert "not measured on this machine" in result.steps[1].observation
        assert result.reward == 0.0 and not result.correct


# ---- GPU: every solution is correct, a wrong kernel is not ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_solution_passes_cuda_check(spec):
    from tools.cuda import cuda_check

    result = cuda_check(spec.solution, spec.module)
    assert result.measured, result.summary()
    assert result.correct, result.summary()


@pytest.mark.gpu
def test_a_wrong_kernel_fails_cuda_check():
    from tools.cuda import cuda_check

    spec = get_kernel_task("level1/relu")
    wrong = spec.solution.replace("fmaxf(a, 0.0f)", "fmaxf(a, 0.1f)")
    assert wrong != spec.solution
    result = cuda_check(wrong, spec.module)
    assert result.measured and result.correct is False and result.max_abs_err == pytest.approx(0.1, abs=1e-3)


# ---- what a kernel run records for the learner (LEAP) ------------------------------------------------------


def _record_run(tok, tmp_path, task):
    import asyncio

    from agents.config import AgentConfig
    from agents.loop import AgentLoop
    from tests.agents._scripted import ScriptedEngine, make_client
    from tools.builtins import default_registry

    problem = task.problems(1)[0]
    engine = ScriptedEngine(tok, [f"```cuda\n{problem.answer}```"] * 4)
    client, recorder, store = make_client(tok, engine, tmp_path)
    loop = AgentLoop(AgentConfig(name="k-agent", max_turns=2), client, default_registry(), task=task)

    async def go():
        try:
            return await loop.run([{"role": "user", "content": problem.prompt}], session_id="s", problem=problem, seed=1)
        finally:
            await recorder.flush()

    result = asyncio.run(go())
    recorder.close()
    from learner.records.store import SqliteStore

    view = SqliteStore(tmp_path / "interactions.db")
    try:
        return result, view.get_trajectory(result.trajectory_id)
    finally:
        view.close()


def test_rank_mode_records_correctness_as_the_reward_and_speed_as_the_score(tiny_model_path, tmp_path):
    # reward="rank" used to be invisible to the trajectory: the loop recorded Kevin's uncapped score as the reward
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    task = KernelTask(level=1, reward="rank", max_turns=2, toolset=Recorded(compiled_ok, correct=True, speedup=2.5).toolset)
    result, traj = _record_run(tok, tmp_path, task)
    assert result.correct is True and result.reward == 1.0
    [outcome] = [r for r in traj.rewards if r.target == "trajectory"]
    assert outcome.value == 1.0 and outcome.source == "verifier:kernels"
    assert traj.meta["correct"] is True and traj.meta["score"] == pytest.approx(2.8)  # the rank estimator orders by it


def test_unmeasured_kernels_are_recorded_as_unknown_not_incorrect(tiny_model_path, tmp_path):
    # no GPU: the kernel compiled but could not be checked; recorded as incorrect, a compile-only group was ranked by length alone
    from transformers import AutoTokenizer

    from tools.cuda import CheckResult

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))

    def check(source, reference, **kw):
        return CheckResult(
            measured=False, reason="no GPU", compiled=True, correct=None, max_abs_err=None, diagnostics=[], elapsed_s=0.1, timed_out=False
        )

    tools = KernelToolset(compile=compiled_ok, check=check, bench=lambda *a, **k: None, device=lambda: (False, "no GPU"))
    result, traj = _record_run(tok, tmp_path, KernelTask(level=1, reward="rank", max_turns=2, toolset=tools))
    assert result.correct is None and traj.meta["correct"] is None and result.reward == 0.0
    from learner.advantages import compute_advantages
    from learner.config import SampleConfig
    from learner.samples import SkipCounts, trajectory_samples

    ts = [s.to_turn_sample() for s in trajectory_samples(traj, family="f", min_version=0, cfg=SampleConfig(), counts=SkipCounts())]
    assert ts[0].correct is None and compute_advantages("rank", ts).n_excluded == len(ts)
