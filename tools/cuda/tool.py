"""The agent-facing tools ``cuda_compile``, ``cuda_check`` and ``cuda_bench``: the plain functions, as observations.

    registry.register(compile_tool)              # named "cuda_compile" (the @tool mark)
    await registry.call("cuda_check", {"source": src, "task": "agents.tasks.kernels.level1.relu"})

Each returns a ``ToolResult`` whose ``content`` is the result's ``summary()`` (what the model reads: errors
with file:line, "CORRECT (max abs error …)", "speedup 1.83x", or plainly "no CUDA device: … not
measured") and whose ``flags`` are the result's ``to_dict()`` without the raw log, so an agent or a
verifier can read ``correct``/``speedup``/``measured`` as data. ``ok`` is false, with an ``error_kind``,
when the source did not compile (``compile_error``), timed out (``timeout``) or was measured incorrect
(``incorrect``). Bad arguments (an empty source, an unknown task) raise ``ValueError``, which the registry
turns into a ``tool_error`` observation. The calls block (the registry runs them in a thread).

Time limits: the functions' defaults (compile 180 s, check/bench 300 s), or ``LOOPWISE_CUDA_TIMEOUT_S`` for
all three: a compile that includes ``<torch/extension.h>`` takes minutes on a small CPU machine.
"""

from __future__ import annotations

import os
from typing import Any

from tools.cuda.api import cuda_bench, cuda_check, cuda_compile
from tools.registry import ToolResult, tool


def _timeout(default: float) -> float:
    value = os.environ.get("LOOPWISE_CUDA_TIMEOUT_S")
    return float(value) if value else default


def _result(content: str, flags: dict[str, Any], error_kind: str | None) -> ToolResult:
    flags = {k: v for k, v in flags.items() if k != "log"}
    return ToolResult(content=content, ok=error_kind is None, error_kind=error_kind, flags=flags)


def compile_tool(source: str) -> ToolResult:
    """Compile a CUDA C++ source (a PyTorch extension) with nvcc and report errors and warnings with line numbers.

    Args:
        source: The complete .cu file: #include <torch/extension.h>, a `torch::Tensor forward(...)` function and
            PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }.
    """
    r = cuda_compile(source, timeout_s=_timeout(180.0))
    kind = "timeout" if r.timed_out else None if r.ok else "compile_error"
    return _result(r.summary(), r.to_dict(), kind)


def check_tool(source: str, task: str) -> ToolResult:
    """Build the kernel, run it on the task's seeded inputs and compare its output with the PyTorch reference.

    Args:
        source: The complete .cu file (a PyTorch extension defining and binding `forward`).
        task: The task's reference module: a dotted module path or a .py file defining Model, get_inputs and get_init_inputs.
    """
    r = cuda_check(source, task, timeout_s=_timeout(300.0))
    kind = "timeout" if r.timed_out else "compile_error" if not r.compiled and r.correct is False else "incorrect" if r.correct is False else None
    return _result(r.summary(), r.to_dict(), kind)


def bench_tool(source: str, task: str) -> ToolResult:
    """Time the kernel against eager PyTorch on the task's inputs (CUDA events, median of 50 runs) and report the speedup.

    Args:
        source: The complete .cu file (a PyTorch extension defining and binding `forward`).
        task: The task's reference module: a dotted module path or a .py file defining Model, get_inputs and get_init_inputs.
    """
    r = cuda_bench(source, task, timeout_s=_timeout(300.0))
    compile_failed = r.reason.startswith("compile failed")
    kind = "timeout" if r.timed_out else "compile_error" if compile_failed else "incorrect" if r.correct is False else None
    return _result(r.summary(), r.to_dict(), kind)


# Marked in place (the functions are returned unchanged), so register() and register_dotted() use these names.
tool(compile_tool, name="cuda_compile")
tool(check_tool, name="cuda_check")
tool(bench_tool, name="cuda_bench")
CUDA_TOOLS = (compile_tool, check_tool, bench_tool)
