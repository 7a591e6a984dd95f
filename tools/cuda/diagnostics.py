"""Parse nvcc's output (its own messages, cudafe++/EDG, the host compiler, ptxas) into ``Diagnostic`` records.

    parse_diagnostics('kernel.cu(12): error: identifier "x" is undefined')
    # [Diagnostic(file='kernel.cu', line=12, severity='error', message='identifier "x" is undefined')]

Formats recognised, one message per line (the source echo and caret lines that follow are not kept):

- EDG front end (cudafe++): ``file(12): error: ...``, ``file(12): warning #549-D: ...``, ``file(3): catastrophic
  error: ...`` and the older ``"file", line 12: error: ...``;
- GCC (preprocessing and the host pass): ``file:12:5: error: ...``, ``file:12: warning: ...``, ``file: note: ...``,
  and tool-level lines such as ``cc1plus: fatal error: ...`` or ``g++: error: ...``;
- ``ptxas warning : ...``, ``ptxas error   : ...``, ``ptxas info    : ...`` (info becomes a note), optionally with
  ``ptxas file.ptx, line 5; error   : ...``; ``nvcc fatal   : ...``, ``nvcc warning : ...``, ``nvlink error : ...``.

Severities are normalised to ``error`` (also fatal and catastrophic errors), ``warning``, ``remark`` and ``note``.
Identical messages are reported once (EDG checks the source twice, for the device and the host pass, and
repeats its warnings). Build-system lines (ninja's ``FAILED:``/``[1/2]`` lines, the command lines) and
summaries (``1 error detected in the compilation of ...``, nvcc's ``Remark: The warnings can be suppressed``)
are not diagnostics and are skipped. Pure functions: nothing here runs a compiler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

_SEVERITY = r"(?P<severity>catastrophic error|fatal error|error|warning|remark|note|info)"
_CODE = r"(?:\s*#\d+(?:-D)?)?"  # EDG's diagnostic number, e.g. "warning #549-D"

_PATTERNS = [
    # EDG / cudafe++: kernel.cu(12): error: ...   kernel.cu(90): warning #3306-D: ...
    re.compile(r"^(?P<file>[^\s:()][^():]*?)\((?P<line>\d+)\):\s*" + _SEVERITY + _CODE + r"\s*:\s*(?P<message>.*)$"),
    # older EDG: "kernel.cu", line 12: error: ...
    re.compile(r'^"(?P<file>[^"]+)", line (?P<line>\d+)(?:, col(?:umn)? (?P<column>\d+))?:\s*' + _SEVERITY + _CODE + r"\s*:\s*(?P<message>.*)$"),
    # ptxas/nvlink with a location: ptxas /tmp/x.ptx, line 5; error   : ...
    re.compile(r"^(?P<tool>ptxas|nvlink)\s+(?P<file>\S+), line (?P<line>\d+);\s*" + _SEVERITY + r"\s*:\s*(?P<message>.*)$"),
    # nvcc / ptxas / nvlink / cicc / fatbinary: "ptxas warning : ...", "nvcc fatal   : ..."
    re.compile(r"^(?P<tool>nvcc|ptxas|nvlink|cicc|fatbinary|cudafe\+\+)\s+(?P<severity>fatal|error|warning|info|remark)\s*:\s*(?P<message>.*)$"),
    # GCC with a location: kernel.cu:12:5: error: ...   kernel.cu:12: warning: ...
    re.compile(r"^(?P<file>[^\s:][^:]*?):(?P<line>\d+):(?:(?P<column>\d+):)?\s*" + _SEVERITY + r"\s*:\s*(?P<message>.*)$"),
    # GCC tool level: cc1plus: fatal error: ...   g++: error: ...   kernel.cu: note: ...
    re.compile(r"^(?P<file>[^\s:][^:]*?):\s*" + _SEVERITY + r"\s*:\s*(?P<message>.*)$"),
]

_NORMALISE = {"catastrophic error": "error", "fatal error": "error", "fatal": "error", "info": "note"}


@dataclass(frozen=True)
class Diagnostic:
    """One compiler message. ``line``/``column`` are 1-based; ``None`` when the tool gave no location."""

    file: str
    line: int | None
    severity: str  # "error" | "warning" | "remark" | "note"
    message: str
    column: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{where}: {self.severity}: {self.message}"


def parse_line(line: str) -> Diagnostic | None:
    """The diagnostic on one line of compiler output, or ``None`` when the line is not one."""
    text = line.rstrip()
    if not text or text[0].isspace():
        return None  # source echoes, carets and continuation lines are indented
    for pattern in _PATTERNS:
        match = pattern.match(text)
        if match is None:
            continue
        groups = match.groupdict()
        severity = groups["severity"]
        severity = _NORMALISE.get(severity, severity)
        file = groups.get("file") or groups.get("tool") or ""
        line_no = groups.get("line")
        column = groups.get("column")
        return Diagnostic(
            file=file,
            line=int(line_no) if line_no else None,
            severity=severity,
            message=groups["message"].strip(),
            column=int(column) if column else None,
        )
    return None


def parse_diagnostics(output: str | Iterable[str]) -> list[Diagnostic]:
    """All diagnostics in a compiler log, in order, each distinct one once."""
    lines = output.splitlines() if isinstance(output, str) else output
    seen: set[Diagnostic] = set()
    out: list[Diagnostic] = []
    for line in lines:
        diag = parse_line(line)
        if diag is not None and diag not in seen:
            seen.add(diag)
            out.append(diag)
    return out


def count(diagnostics: Iterable[Diagnostic], severity: str) -> int:
    return sum(1 for d in diagnostics if d.severity == severity)
