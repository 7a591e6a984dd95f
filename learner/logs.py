"""One log format per destination, for every loopwise process: the server and the learner it starts.

``configure_logging(level, fmt, process)`` is called once by each entry point (``serve.py``,
``python -m learner run``), never at import. It routes the standard library's logging, structlog and
Python warnings through one handler on stderr:

- ``fmt="console"``: one readable line per event, ``12:03:04 info  runtime.app: serving model tiny key=value``
  (colours on a terminal); the learner's lines carry a ``learner`` tag.
- ``fmt="json"``: one JSON object per line (``timestamp``, ``level``, ``logger``, ``process``,
  ``event``, the event's fields), for log collectors.
- ``fmt="auto"`` (the default): ``console`` when stderr is a terminal, else ``json``.

Internal HTTP calls (``httpx``/``httpcore``, e.g. the learner's admin calls) are logged at DEBUG, so
they show only with ``--log-level debug``. Below DEBUG, third-party warnings are dropped (deprecation
and future warnings from anywhere, other warnings raised inside libraries); what is left goes through
the same handler. When not writing for a terminal, Hugging Face progress bars are off.

:class:`StatusLine` is one live line at the bottom of the terminal (``rich``), e.g. the demo's status:
log lines, and anything else written to stdout/stderr, are printed above it instead of tearing it.
It is inert in ``json`` mode. :func:`relay` copies another process's output (the learner's, already
formatted the same way) line by line through this process's stderr, so it passes above the status
line too.

It lives in ``learner`` because both entry points may import it (``serve.py`` imports anything;
the learner imports nothing of the runtime). Not here: what is logged (each module decides).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import IO, Any, Literal

import structlog

Format = Literal["auto", "console", "json"]
PROJECT = ("runtime", "learner", "agents", "memory", "tools", "serve", "bench", "__main__")
QUIET_HTTP = ("httpx", "httpcore")
ENV_FORMAT = "LOOPWISE_LOG_FORMAT"  # set by serve.py for the learner it starts: the same format on the same terminal
ENV_COLORS = "LOOPWISE_LOG_COLORS"

_state: dict[str, Any] = {"fmt": "json", "live": None}


def resolve_format(fmt: str | None, stream: IO[str] | None = None) -> Literal["console", "json"]:
    """``auto`` (or None) → ``console`` on a terminal, else ``json``."""
    if fmt in ("console", "json"):
        return fmt  # type: ignore[return-value]
    stream = stream or sys.stderr
    return "console" if getattr(stream, "isatty", lambda: False)() else "json"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that looks ``sys.stderr`` up at every record, so a live status line's redirect catches it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:  # logging sets it in __init__; the property always answers sys.stderr
        pass


class _DemoteHttp(logging.Filter):
    """httpx/httpcore INFO lines (one per internal request) become DEBUG, and are dropped unless DEBUG is on."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] in QUIET_HTTP and record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record.levelno >= self.level


def _tag_process(process: str) -> Callable[[Any, str, dict[str, Any]], dict[str, Any]]:
    def tag(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("process", process)
        return event

    return tag


def _console_process_prefix(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """Console lines of the learner start with ``learner │``; the server's need no tag."""
    process = event.pop("process", None)
    if process and process != "server":
        event["event"] = f"{process} │ {event.get('event', '')}"
    return event


def _console_renderer(colors: bool) -> Any:
    from structlog.dev import ConsoleRenderer, RichTracebackFormatter

    # no locals in tracebacks: they may hold keys and request bodies
    return ConsoleRenderer(colors=colors, pad_event=0, exception_formatter=RichTracebackFormatter(show_locals=False, max_frames=20))


def configure_logging(level: str = "info", fmt: str | None = "auto", process: str = "server") -> Literal["console", "json"]:
    """Configure logging, structlog and warnings for this process; returns the format chosen."""
    chosen = resolve_format(fmt or os.environ.get(ENV_FORMAT))
    numeric = logging.getLevelName(level.upper())
    numeric = numeric if isinstance(numeric, int) else logging.INFO
    timestamper = structlog.processors.TimeStamper(fmt="%H:%M:%S" if chosen == "console" else "iso", utc=chosen != "console")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _tag_process(process),
        timestamper,
    ]
    if chosen == "console":
        colors = os.environ.get(ENV_COLORS) == "1" or sys.stderr.isatty()
        final: list[Any] = [_console_process_prefix, _console_renderer(colors)]
    else:
        final = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = _StderrHandler()
    handler.addFilter(_DemoteHttp(numeric))
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final])
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    _filter_warnings(debug=numeric <= logging.DEBUG)
    if chosen == "json" or not sys.stderr.isatty():  # before transformers is imported: no bars in a log file or a relay
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    _state["fmt"] = chosen
    return chosen


def _filter_warnings(debug: bool) -> None:
    logging.captureWarnings(True)  # what is left is logged (logger py.warnings), in the same format
    if debug:
        return
    not_ours = r"(?!(" + "|".join(PROJECT) + r")\b)"
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", module=not_ours)  # raised inside a library (its stack level points there)


class StatusLine:
    """One live line at the bottom of the terminal; log lines print above it. Inert unless logging is ``console``."""

    def __init__(self, refresh_per_second: float = 2.0) -> None:
        self.enabled = _state["fmt"] == "console" and sys.stderr.isatty()
        self._live: Any = None
        self._refresh = refresh_per_second

    def start(self) -> StatusLine:
        if self.enabled and self._live is None:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            self._live = Live(Text(""), console=Console(stderr=True), refresh_per_second=self._refresh, transient=True)
            self._live.start()  # redirects stdout and stderr: whatever is written prints above the line
            # rich computes a printed line's cursor reset under the Live's lock but writes it after releasing it, so a
            # refresh in between (its own thread) could draw the status line first and the log line would land on it
            sys.stdout, sys.stderr = _Serialized(sys.stdout, self._live._lock), _Serialized(sys.stderr, self._live._lock)
            # keep the cursor: a server killed by SIGTERM (uvicorn re-raises it) never reaches stop() to show it again
            self._live.console.show_cursor(True)
            atexit.register(self.stop)
        return self

    def update(self, text: str) -> None:
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(text, no_wrap=True, overflow="ellipsis"))

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class _Serialized:
    """A live display's stdout/stderr redirect whose writes hold the display's lock, so no refresh lands mid-print.

    Everything else (``rich_proxied_file``, ``isatty``, ``fileno``) is the wrapped proxy's; ``Live.stop`` puts the
    original streams back."""

    def __init__(self, inner: Any, lock: Any) -> None:
        self._inner, self._lock = inner, lock

    def write(self, text: str) -> int:
        with self._lock:
            return int(self._inner.write(text))

    def flush(self) -> None:
        with self._lock:
            self._inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def relay(stream: IO[bytes], name: str = "relay") -> threading.Thread:
    """Copy ``stream`` (another process's output) line by line to this process's current stderr, in a daemon thread."""

    def run() -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            try:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone (shutting down): drain quietly
                pass
        stream.close()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
