"""The built-in tools and ``default_registry()``: calculator, python, the CUDA kernel tools, and tools named in configuration.

    registry = default_registry()                                  # calculator, python, cuda_compile/check/bench
    registry = default_registry(extra=["mypkg.tools:search"])      # plus user tools by import path

The ``python`` tool's sandbox is created lazily on its first call, so building a registry never
probes the machine; pass ``sandbox=`` to share one (or to choose its limits). The CUDA tools
(``tools.cuda``) probe nothing either until called; ``cuda=False`` leaves them out.
"""

from __future__ import annotations

from collections.abc import Iterable

from tools.calculator import calculator
from tools.cuda.tool import CUDA_TOOLS
from tools.python_runner import python_tool
from tools.registry import ToolRegistry
from tools.sandbox import Sandbox, SandboxLimits


def default_registry(
    *,
    sandbox: Sandbox | None = None,
    limits: SandboxLimits | None = None,
    extra: Iterable[str] = (),
    python: bool = True,
    cuda: bool = True,
) -> ToolRegistry:
    """A registry with ``calculator``, ``python`` and the CUDA tools (each group can be left out), plus ``extra`` dotted paths."""
    registry = ToolRegistry()
    registry.register(calculator)
    if python:
        registry.register(python_tool(sandbox, limits), "python")
    if cuda:
        for fn in CUDA_TOOLS:
            registry.register(fn)
    for dotted in extra:
        registry.register_dotted(dotted)
    return registry
