"""Parsing JSON a client sent as *text*: under the same depth and size limits as a request body.

Request bodies are parsed by ``runtime/http_body.py``, which refuses JSON nested more than ``MAX_DEPTH``
levels. JSON inside a string of the body (tool-call ``arguments``, a Responses ``function_call`` item's
``arguments``) and JSON in files a client points at (an adapter's ``adapter_config.json``) are parsed
later, by the code that needs them: ``loads_json_text`` and ``read_json_file`` are for those places.
``json.loads`` raises ``RecursionError`` past about a thousand levels (a 500), and a value a little
shallower than that makes recursive consumers (templates, validators) fail the same way.

What Python's parser accepts beyond JSON is refused here too: ``NaN``, ``Infinity`` and ``-Infinity`` (no JSON
encoder downstream can write them back: a reply echoing one failed with a 500), and integers of more than
``MAX_INT_DIGITS`` digits (Python's parser raises a bare ``ValueError`` for those, which no caller expected).
``loads_strict`` is the parser with those rules, for the request body too.

Both raise ``JSONLimitExceeded`` for text over the limits. It is a ``json.JSONDecodeError``, so a caller
that already turns invalid JSON into a 400 (``except json.JSONDecodeError as exc: ... exc.msg``) needs
only to call ``loads_json_text`` instead of ``json.loads``; its ``msg`` names the limit.

Not here: reading request bodies (``runtime/http_body.py``), or what the parsed value must contain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_DEPTH = 64  # arrays and objects inside each other; real requests (tool schemas included) stay far below
MAX_CHARS = 4 * 1024 * 1024  # the default request body limit: text inside a body is never larger
MAX_INT_DIGITS = 4300  # Python's own limit for int() of a string (sys.get_int_max_str_digits' default)


class JSONLimitExceeded(json.JSONDecodeError):
    """JSON text nested deeper than ``MAX_DEPTH`` or longer than the size limit; ``msg`` names the limit."""

    def __init__(self, msg: str, doc: str) -> None:
        super().__init__(msg, doc[:200], 0)  # the document is not kept: it may be megabytes
        self.args = (msg,)  # str(exc) is the limit alone, without "line 1 column 1 (char 0)"


class NotJSON(ValueError):
    """A value Python's parser would take that JSON does not have (``NaN``, ``Infinity``) or an integer too long to read."""


class NonFinite(NotJSON):
    """``NaN``, ``Infinity`` or ``-Infinity`` where JSON has a number."""


def _constant(name: str) -> Any:
    raise NonFinite(f"{name} is not a JSON value (JSON numbers are finite)")


def non_finite_path(text: str) -> str | None:
    """Where ``text`` (JSON that :func:`loads_strict` refused with :class:`NonFinite`) holds the first ``NaN`` or
    ``Infinity``, as a field path (``reward``, ``tools[0].parameters.maximum``); None if it cannot say."""
    import math

    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path or None
        if isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def _int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise NotJSON(f"an integer of {len(digits)} digits is longer than the {MAX_INT_DIGITS} digits this server reads")
    return int(digits)


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` refusing ``NaN``/``Infinity`` and over-long integers with :class:`NotJSON` (a ``ValueError``)."""
    return json.loads(text, parse_constant=_constant, parse_int=_int)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests more than ``limit`` containers deep (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def loads_json_text(text: str | bytes, *, max_chars: int = MAX_CHARS, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, refusing text longer than ``max_chars`` or nested deeper than ``max_depth``.

    Raises ``json.JSONDecodeError`` for invalid JSON and its subclass ``JSONLimitExceeded`` for the limits."""
    if len(text) > max_chars:
        raise JSONLimitExceeded(f"the JSON text is longer than {max_chars} characters", _doc(text))
    try:
        value = loads_strict(text)
    except NotJSON as exc:
        raise JSONLimitExceeded(str(exc), _doc(text)) from None
    except RecursionError:  # nested deeper than the parser's own stack allows
        value, deep = None, True
    else:
        deep = too_deep(value, max_depth)
    if deep:
        raise JSONLimitExceeded(f"the JSON text is nested more than {max_depth} levels deep", _doc(text))
    return value


def read_json_file(path: Path, *, max_bytes: int = MAX_CHARS, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON file parsed by ``loads_json_text``; a file over ``max_bytes`` is refused before it is read whole.

    Raises ``OSError`` when it cannot be read, ``UnicodeDecodeError`` for bytes that are not UTF-8, and
    ``json.JSONDecodeError`` (``JSONLimitExceeded`` for the limits) as ``loads_json_text`` does."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise JSONLimitExceeded(f"the JSON file is larger than {max_bytes} bytes", "")
    return loads_json_text(raw.decode("utf-8"), max_chars=max_bytes, max_depth=max_depth)


def _doc(text: str | bytes) -> str:
    return text[:200] if isinstance(text, str) else text[:200].decode("utf-8", "replace")
