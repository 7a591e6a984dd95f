"""loopwise tools: a registry of typed Python functions exposed as OpenAI tools, a sandbox, built-ins.

Public API: ``ToolRegistry``, ``Tool``, ``ToolResult``, ``tool``, ``load_tool``, ``default_registry``,
``Sandbox``, ``SandboxLimits``, ``SandboxResult``, ``calculator``, ``python_tool``, and the errors
``ToolError`` ▸ ``ToolRegistrationError``/``ToolLoadError``/``ToolNotFound``, ``SandboxError`` ▸
``SandboxUnavailable``. This package imports nothing else from the project.
"""

from tools.builtins import default_registry
from tools.calculator import CalculatorError, calculator
from tools.python_runner import python_tool
from tools.registry import Tool, ToolError, ToolLoadError, ToolNotFound, ToolRegistrationError, ToolRegistry, ToolResult, load_tool, tool
from tools.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxResult, SandboxUnavailable

__all__ = [
    "CalculatorError",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "Tool",
    "ToolError",
    "ToolLoadError",
    "ToolNotFound",
    "ToolRegistrationError",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "default_registry",
    "load_tool",
    "python_tool",
    "tool",
]
