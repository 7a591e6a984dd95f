"""The ``python`` tool: run a code snippet in the sandbox and describe the outcome compactly for the model.

    registry.register(python_tool(Sandbox()))
    await registry.call("python", {"code": "print(2 + 2)"})   # ToolResult(content="4", ok=True, flags={...})

The observation is stdout, then stderr under a ``[stderr]`` line, then one status line when something
went wrong (``[exit code 1]``, ``[timed out after 10 s]``, ``[memory limit of 512 MB exceeded]``,
``[CPU time limit of 5 s exceeded]``, ``[output truncated at 64000 bytes]``). Tracebacks are shown from
the user's own code (the sandbox bootstrap's frames are removed). Flags carry the same facts as data.

It does not keep state between calls (each call is a fresh process and folder) and offers the standard
library only (the sandbox runs ``python -I -S``). Confinement and its limits: see ``tools.sandbox``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from tools.registry import ToolResult
from tools.sandbox import Sandbox, SandboxLimits, SandboxResult

_BOOT_FRAMES = re.compile(r'  File "<string>", line \d+, in (?:<module>|_lw_boot)\n')


def format_result(result: SandboxResult, limits: SandboxLimits) -> ToolResult:
    """Turn a sandbox result into the tool observation and flags."""
    stderr = _BOOT_FRAMES.sub("", result.stderr)
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if stderr:
        parts.append("[stderr]\n" + stderr.rstrip("\n"))
    status = []
    error_kind: str | None = None
    if result.timed_out:
        status.append(f"timed out after {limits.wall_s:g} s")
        error_kind = "timeout"
    if result.cpu_exceeded:
        status.append(f"CPU time limit of {limits.cpu_s:g} s exceeded")
        error_kind = error_kind or "cpu_exceeded"
    if result.memory_exceeded:
        status.append(f"memory limit of {limits.memory_mb} MB exceeded")
        error_kind = error_kind or "memory_exceeded"
    if result.output_truncated:
        status.append(f"output truncated at {limits.output_bytes} bytes")
        error_kind = error_kind or "output_truncated"
    if result.exit_code not in (0, None):
        status.append(f"exit code {result.exit_code}")
        error_kind = error_kind or "exit_code"
    elif result.signal is not None and not (result.timed_out or result.cpu_exceeded or result.output_truncated):
        status.append(f"killed by signal {result.signal}")
        error_kind = error_kind or "signal"
    if status:
        parts.append("[" + "; ".join(status) + "]")
    content = "\n".join(parts) if parts else "(no output)"
    flags = {
        "exit_code": result.exit_code,
        "signal": result.signal,
        "timed_out": result.timed_out,
        "memory_exceeded": result.memory_exceeded,
        "cpu_exceeded": result.cpu_exceeded,
        "truncated": result.output_truncated,
        "wall_s": round(result.wall_s, 4),
    }
    return ToolResult(content=content, ok=result.ok, error_kind=None if result.ok else error_kind, flags=flags)


def python_tool(sandbox: Sandbox | None = None, limits: SandboxLimits | None = None) -> Callable[[str], Awaitable[ToolResult]]:
    """Build the ``python`` tool bound to a sandbox (created on first use when not given)."""
    holder: list[Sandbox] = [sandbox] if sandbox is not None else []

    async def python(code: str) -> ToolResult:
        """Run Python 3 code (standard library only) in a fresh sandbox and return what it prints.

        Args:
            code: A complete Python program. Print the values you need; nothing is kept between calls. No network access.
        """
        if not holder:  # the first call probes the machine (a few subprocesses): keep it off the event loop
            holder.append(await asyncio.to_thread(Sandbox, limits or SandboxLimits()))
        box = holder[0]
        lim = limits or box.limits
        return format_result(await box.arun_python(code, limits=lim), lim)

    return python
