"""Parsing JSON a client sent as *text*: under the same depth and size limits as a request body.

Request bodies are parsed by ``runtime/http_body.py``, which refuses JSON nested more than ``MAX_DEPTH``
levels. JSON inside a string of the body (tool-call ``arguments``, a Responses ``function_call`` item's
``arguments``) and JSON in files a client points at (an adapter's ``adapter_config.json``) are parsed
later, by the code that needs them: ``loads_json_text`` and ``read_json_file`` are for those places.
``json.loads`` raises ``RecursionError`` past about a thousand levels (a 500), and a value a little
shallower than that makes recursive consumers (templates, validators) fail the same way.

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


class JSONLimitExceeded(json.JSONDecodeError):
    """JSON text nested deeper than ``MAX_DEPTH`` or longer than the size limit; ``msg`` names the limit."""

    def __init__(self, msg: str, doc: str) -> None:
        super().__init__(msg, doc[:200], 0)  # the document is not kept: it may be megabytes
        self.args = (msg,)  # str(exc) is the limit alone, without "line 1 column 1 (char 0)"


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
        value = json.loads(text)
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
