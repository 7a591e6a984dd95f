"""What every Python script of the client sweep shares: the server it talks to, running one call, and classifying its failure.

``bench/client_sweep.py`` runs each ``*_calls.py`` beside this file with the library's own virtualenv's python, from a
folder outside the checkout, with ``SWEEP_URL`` (``http://127.0.0.1:PORT/v1``), ``SWEEP_API_KEY`` and ``SWEEP_MODEL``
set (and the usual ``OPENAI_*`` / ``ANTHROPIC_*`` variables pointing at the same server). A script calls :func:`header`
once, then :func:`run` per call (:func:`main` does both); each prints one JSON line at once, so a script that dies half-way still reports the
calls it made. Only the standard library is used here: the scripts' virtualenvs have nothing else in common.

A call's record: ``status`` ``pass`` / ``server-fail`` / ``model-fail``, the ``error`` text, ``basis`` (why it was
classified so), ``http`` (the server's own count of the statuses it answered during the call, read from ``/metrics``
before and after, so a library that swallowed an HTTP error is still seen) and ``detail`` (what came back, shortened).

Classification, in order:

1. the call raised :class:`ModelSide` or :class:`ServerSide` itself (the script checked the library's parsed result);
2. the server answered an HTTP status >= 400 during the call, or the exception (or one it was raised from) carries one:
   server-side; except a 400 whose text is the context-window refusal (``maximum context length``): an agent whose
   steps filled the model's window with its own output, which the server must refuse (model-side, and said so);
3. a connection or timeout error: server-side;
4. the library's own exception (retry wrappers looked through) is of the kinds libraries raise on output they parsed
   but could not accept (validation, a JSON decode of the model's text, an output parser's, an agent's step that
   produced no usable action): model-side;
5. anything else: server-side (a protocol error the library could not parse), marked ``basis: "unrecognised error"``
   so that it is read and judged by a person, not trusted.

What it does not do: retry. A call runs once; a failure is a failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable
from typing import Any

URL = os.environ["SWEEP_URL"].rstrip("/")
BASE = URL.removesuffix("/v1")
KEY = os.environ["SWEEP_API_KEY"]
MODEL = os.environ["SWEEP_MODEL"]
WEATHER_PROMPT = "What is the weather in Paris right now? Use the get_weather tool."


class ModelSide(Exception):
    """The library parsed the server's answer, but the model's output did not satisfy it."""


class ServerSide(Exception):
    """The server's answer was wrong in a way the script itself checked."""


_METRIC = re.compile(r'^loopwise_requests_total\{endpoint="([^"]*)",status="(\d+)"\}\s+([0-9.e+]+)', re.M)
_BUSY = re.compile(r"^loopwise_(?:running_requests|queue_depth)\s+([0-9.e+]+)", re.M)
_MODEL_SIDE_NAMES = (
    "ValidationError",
    "JSONDecodeError",
    "OutputParserException",
    "UnexpectedModelBehavior",
    "ModelBehaviorError",
    "InstructorRetryException",
    "IncompleteOutputException",
    "AdapterParseError",
    "AgentParsingError",
    "AgentMaxStepsError",
    "MaxTurnsExceeded",
    "ToolCallError",
    "LengthFinishReasonError",
)
_WRAPPERS = ("RetryError", "ExceptionGroup", "BaseExceptionGroup")
_TRANSPORT_NAMES = ("ConnectionError", "ConnectError", "APIConnectionError", "Timeout", "RemoteProtocolError", "ReadError")


def _metrics() -> str:
    with urllib.request.urlopen(BASE + "/metrics", timeout=30) as r:
        return str(r.read().decode())


def statuses(text: str | None = None) -> dict[str, int]:
    """The server's request counter, ``"endpoint status" -> n`` (``/metrics`` itself left out)."""
    return {f"{e} {s}": int(float(n)) for e, s, n in _METRIC.findall(text or _metrics()) if e != "/metrics"}


def settled(limit_s: float = 30.0) -> dict[str, int]:
    """:func:`statuses` once the server has nothing in flight: a request is counted when its answer has been sent, and a
    stream the library gave up on mid-way is still being answered for a while (up to ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    last: dict[str, int] | None = None
    while True:
        time.sleep(0.1)
        text = _metrics()
        now = statuses(text)
        idle = not any(float(v) > 0 for v in _BUSY.findall(text))
        if (idle and now == last) or time.monotonic() > deadline:
            return now
        last = now


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n - before.get(k, 0) > 0}


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen) or len(seen) > 20:
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        last = getattr(e, "last_attempt", None)  # tenacity's RetryError
        if last is not None and hasattr(last, "exception"):
            todo.append(last.exception())
    return seen


def _http_status(e: BaseException) -> int | None:
    for attr in ("status_code", "status"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 400 <= v < 600:
            return v
    resp = getattr(e, "response", None)
    v = getattr(resp, "status_code", None)
    return v if isinstance(v, int) and 400 <= v < 600 else None


def classify(exc: BaseException, http: dict[str, int]) -> tuple[str, str]:
    """``(status, basis)`` of a call that raised ``exc`` while the server answered ``http``."""
    chain = _chain(exc)
    if any(isinstance(e, ModelSide) for e in chain[:1]):
        return "model-fail", "checked by the script"
    if any(isinstance(e, ServerSide) for e in chain[:1]):
        return "server-fail", "checked by the script"
    bad = [k for k in http if int(k.rsplit(" ", 1)[1]) >= 400]
    if bad and all(k.endswith(" 400") for k in bad) and "maximum context length" in str(exc):
        return "model-fail", "HTTP 400: the prompt outgrew the model's context window (the model's limit, filled by its own output)"
    if bad:
        return "server-fail", "HTTP " + ", ".join(bad)
    for e in chain:
        if (code := _http_status(e)) is not None:
            return "server-fail", f"HTTP {code} in {type(e).__name__}"
    names = [type(e).__name__ for e in chain]
    if any(any(t in n for t in _TRANSPORT_NAMES) for n in names):
        return "server-fail", "transport: " + " <- ".join(names)
    if any(isinstance(e, ModelSide) for e in chain):
        return "model-fail", "checked by the script"
    # the error the library itself raised (under retry wrappers): a validation error deeper down may be the library
    # failing to read the server's answer, which is not the model's doing
    top = next((n for n in names if n not in _WRAPPERS), names[0])
    if any(m in top for m in _MODEL_SIDE_NAMES):
        return "model-fail", "output rejected: " + " <- ".join(names)
    return "server-fail", "unrecognised error: " + " <- ".join(names)


def header(library: str, packages: tuple[str, ...], calls: list[str]) -> None:
    """The script's first line: the library, the installed versions of ``packages`` and the calls it will make."""
    from importlib.metadata import PackageNotFoundError, version

    versions: dict[str, str] = {}
    for p in packages:
        try:
            versions[p] = version(p)
        except PackageNotFoundError:
            versions[p] = "not installed"
    print(json.dumps({"library": library, "versions": versions, "python": sys.version.split()[0], "calls": calls}), flush=True)


def short(value: Any, n: int = 160) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def run(name: str, call: Callable[[], Any]) -> None:
    """Run ``call()`` once and print its record; ``call`` returns what came back (shown shortened as ``detail``)."""
    before = statuses()
    t0 = time.perf_counter()
    record: dict[str, Any] = {"call": name}
    try:
        detail = call()
        record |= {"status": "pass", "detail": short(detail)}
        error: BaseException | None = None
    except Exception as exc:  # the whole point: report it, then go on with the next call
        error = exc
        record |= {"error": short(f"{type(exc).__name__}: {exc}", 600), "trace": short(traceback.format_exc(limit=-4), 1200)}
        causes = [f"{type(e).__name__}: {e}" for e in _chain(exc)[1:3]]
        if causes:  # what the library's error was raised from (a validation's text says what the output lacked)
            record["cause"] = short(" <- ".join(causes), 600)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["http"] = _diff(before, settled())
    if error is not None:
        record["status"], record["basis"] = classify(error, record["http"])
    print(json.dumps(record), flush=True)


def main(library: str, packages: tuple[str, ...], calls: list[tuple[str, Callable[[], Any]]]) -> None:
    """The header, then each call once, in order."""
    header(library, packages, [name for name, _ in calls])
    for name, call in calls:
        run(name, call)
