"""Tool-call parsers: turn raw model output text into OpenAI-style tool calls.

Each parser understands one text format that models use to emit function
calls, registered under the name SGLang uses for ``--tool-call-parser``:

* ``qwen25`` (aliases ``hermes``, ``qwen``): ``<tool_call>{json}</tool_call>`` blocks.
* ``llama3``: Llama 3.1/3.2 JSON, optionally after ``<|python_tag|>``, ``;``-separated.
* ``pythonic``: ``[f(a=1), g(b="x")]``, optionally in ``<|python_start|>``/``<|python_end|>``.
* ``mistral``: ``[TOOL_CALLS] [{json}, ...]`` and ``[TOOL_CALLS]name[ARGS]{json}``.

``parse`` splits a *complete* generation into normal content and tool calls;
``stream_hold_index`` tells a streamer how much text it may flush safely. A parser whose format
can be forced by a grammar (``qwen25``, ``llama3``) has a :class:`CallFormat` (the text the grammar
admits, which ``constraints`` builds its grammar from), and ``parse_cut`` reads a forced call that
the token limit cut short: the call with its arguments as far as they were generated.

What this module does NOT do:

* It does not validate arguments against the tools' JSON schemas (constrained
  decoding or the caller does that); arguments are only required to be a JSON
  object (or, for ``pythonic``, Python literals).
* It does not stream tool-call deltas; streaming code holds text back from
  ``stream_hold_index`` and calls ``parse`` on the full text at the end.
* It never raises on malformed model output and never drops text: anything it
  cannot parse (bad JSON, positional arguments, a name not in ``tool_names``)
  stays in ``content``. The exceptions: ``parse_cut``, for grammar-forced output only: its text is
  never shown as content (a cut call is a call, whatever JSON it holds so far); and a Hermes/Qwen
  ``<tool_call>`` block that is not valid JSON but whose head is readable (``{"name": "<one of the
  tools>", "arguments": {``) is a call all the same, with the model's own text of the arguments object
  as its ``arguments`` (up to where that object closes; never closed, up to the next ``<tool_call>`` /
  ``</tool_call>`` tag or the end): exactly what ``runtime.tool_stream`` streams as the model decodes, so a
  streamed and a non-streamed answer agree. Such arguments may not be valid JSON (the model wrote invalid
  JSON), as OpenAI's own non-strict calls may not be; clients validate them. A block whose head is not
  readable (no name first, an unknown tool, arguments that are not an object, not JSON at all) stays
  content, verbatim.

How vLLM and SGLang treat the same output (``<tool_call>`` JSON that does not parse, ``tool_choice`` auto),
read from their source: vLLM's ``hermes`` parser returns the whole text as content and no call when not
streaming (``vllm/parser/hermes.py``: "non-streaming is all-or-nothing, while streaming keeps the engine's
best-effort behaviour", which streams the call's name and argument text as they come); SGLang 0.5.21's
``hermes`` detector returns the whole text as content, and its ``qwen25`` detector drops the block (the
content is the text before it, the call is logged and lost). loopwise streams calls as they decode, so its
non-streamed answer follows the stream rather than vLLM's non-streamed one.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")


def _ws_end(s: str, i: int) -> int:
    """Where the whitespace starting at ``i`` ends (``\\s*`` always matches)."""
    m = _WS.match(s, i)
    assert m is not None
    return m.end()


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON object text (json.dumps(..., ensure_ascii=False))
    id: str


@dataclass(frozen=True)
class ParseResult:
    content: str | None
    tool_calls: list[ParsedToolCall]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class CallFormat:
    """The one call a grammar-forced output is: ``prefix{"name": <name>, "<args_key>": <arguments>}suffix``."""

    prefix: str
    args_key: str
    suffix: str

    def head(self, name: str) -> str:
        """The call's text up to its arguments (what ``constraints`` makes the grammar admit)."""
        return self.prefix + "{" + json.dumps("name") + ": " + json.dumps(name) + ", " + json.dumps(self.args_key) + ": "

    def tail(self) -> str:
        return "}" + self.suffix


class UnknownToolParser(KeyError, ValueError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass
class _Out:
    """Accumulates content pieces and accepted calls for one parse."""

    tool_names: set[str] | None
    parts: list[str] = field(default_factory=list)
    calls: list[ParsedToolCall] = field(default_factory=list)

    def text(self, s: str) -> None:
        self.parts.append(s)

    def call(self, name: str, args: Any) -> bool:
        if self.tool_names is not None and name not in self.tool_names:
            logger.debug("tool call to unknown tool %r kept as content", name)
            return False
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            logger.debug("tool call %r has non-JSON arguments; kept as content", name)
            return False
        self.calls.append(ParsedToolCall(name, arguments, new_call_id()))
        return True

    def result(self) -> ParseResult:
        return ParseResult("".join(self.parts).strip() or None, self.calls)


def _call_from_obj(obj: Any, require_args: bool = False) -> tuple[str, dict[str, Any]] | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> (name, args), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return None if require_args else (obj["name"], {})
    args = obj[key]
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    return (obj["name"], args) if isinstance(args, dict) else None


def _scan_json(s: str, sep: str, end: str | None = None) -> list[tuple[Any, str]] | None:
    """Decode ``v SEP v SEP ...`` spanning all of ``s`` (or up to ``end`` + whitespace).

    Returns ``[(value, raw_text), ...]`` or None if ``s`` is not exactly that.
    """
    out: list[tuple[Any, str]] = []
    i = _ws_end(s, 0)
    while True:
        try:
            value, j = _DECODER.raw_decode(s, i)
        except (ValueError, RecursionError):
            return None
        out.append((value, s[i:j]))
        i = _ws_end(s, j)
        if i == len(s):
            return out if end is None else None
        if s[i] == sep:
            i = _ws_end(s, i + 1)
            if i == len(s) and end is None:  # tolerate a trailing separator
                return out
            continue
        if end is not None and s[i] == end and not s[i + 1 :].strip():
            return out
        return None


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
# the head of a Hermes/Qwen call up to its arguments object: what a call is known by before its JSON is complete
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)', re.DOTALL)


class ArgsScanner:
    """Where a Hermes/Qwen call's arguments object ends, in text fed as it arrives (streamed or all at once).

    It tracks JSON strings and nesting from the object's ``{``: the arguments end just past the brace that closes
    it (``"closed"``) or, if it never closes, where a ``<tool_call>`` or ``</tool_call>`` tag starts outside a string
    (``"tag"``: markup, which JSON cannot hold there). Anything else the model wrote, valid JSON or not, is part of
    the arguments. Not final, a trailing ``<…`` that may still become a tag is held back."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False

    def feed(self, s: str, final: bool = False) -> tuple[int, str | None]:
        """``(n, how)``: the first ``n`` characters of ``s`` are arguments; ``how`` is ``"closed"``, ``"tag"`` (a tag
        starts at ``n``) or None (more is needed; ``s[n:]`` is held back, unread)."""
        for i, ch in enumerate(s):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, "closed"
            elif ch == "<":
                rest = s[i:]
                if rest.startswith((HERMES_START, HERMES_END)):
                    return i, "tag"
                if not final and (HERMES_START.startswith(rest) or HERMES_END.startswith(rest)):
                    return i, None
        return len(s), None


def could_close(s: str) -> bool:
    """``s`` is (a prefix of) what closes a call after its arguments: whitespace, the wrapper's ``}``, whitespace,
    ``</tool_call>``."""
    t = s.lstrip()
    if t.startswith("}"):
        t = t[1:].lstrip()
    return HERMES_END.startswith(t[: len(HERMES_END)]) and len(t) <= len(HERMES_END)


def _hold_for_markers(text: str, markers: tuple[str, ...]) -> int:
    """Earliest index of a marker in text, or of a partial marker ending text."""
    best = len(text)
    for m in markers:
        i = text.find(m)
        if i >= 0:
            best = min(best, i)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = min(best, len(text) - k)
                break
    return best


class ToolCallParser(ABC):
    name: str = ""
    markers: tuple[str, ...] = ()
    forced: ClassVar[CallFormat | None] = None  # the format a grammar can force, if any

    def detect(self, text: str) -> bool:
        return any(m in text for m in self.markers)

    @abstractmethod
    def parse(self, text: str, tool_names: set[str] | None = None) -> ParseResult: ...

    def stream_hold_index(self, text: str) -> int:
        return _hold_for_markers(text, self.markers)

    def parse_cut(self, text: str, tool_names: set[str]) -> ParseResult:
        """A grammar-forced call to one of ``tool_names`` cut short: the call with the arguments generated so far.

        The arguments are the model's own text from the object's ``{`` (possibly incomplete JSON, as OpenAI and vLLM
        send a cut call; up to the object's end if it was complete). No call when the text does not yet tell which
        tool is called (several names still fit); the text is never content."""
        if self.forced is None:
            return self.parse(text, tool_names)
        heads = {name: self.forced.head(name) for name in sorted(tool_names)}
        fits = [name for name, head in heads.items() if text.startswith(head) or head.startswith(text)]
        if len(fits) != 1:
            return ParseResult(None, [])
        name = fits[0]
        return ParseResult(None, [ParsedToolCall(name, _object_prefix(text[len(heads[name]) :]), new_call_id())])


def _object_prefix(s: str) -> str:
    """``s`` up to the end of the JSON value it starts with, or all of ``s`` if that value is cut short."""
    try:
        _, end = _DECODER.raw_decode(s)
    except (ValueError, RecursionError):
        return s
    return s[:end]


class Qwen25Parser(ToolCallParser):
    name = "qwen25"
    START, END = HERMES_START, HERMES_END
    markers = (START,)
    forced = CallFormat(START + "\n", "arguments", "\n" + END)

    def parse(self, text: str, tool_names: set[str] | None = None) -> ParseResult:
        out, pos = _Out(tool_names), 0
        while (start := text.find(self.START, pos)) >= 0:
            out.text(text[pos:start])
            end = text.find(self.END, start)
            body_start = start + len(self.START)
            end = _json_end(text, body_start, end, self.END)
            if end >= 0:
                body, pos = text[body_start:end], end + len(self.END)
            else:  # generation cut off before </tool_call>
                body, pos = text[body_start:], len(text)
            try:
                call = _call_from_obj(json.loads(body))
            except (ValueError, RecursionError):
                call = None
            if call is not None and out.call(*call):
                continue
            headed = _headed_call(text, body_start, tool_names)
            if headed is not None:  # not JSON, but a call all the same (see the module docstring)
                name, arguments, pos = headed
                out.calls.append(ParsedToolCall(name, arguments, new_call_id()))
                continue
            out.text(text[start:pos])
        out.text(text[pos:])
        return out.result()


def _headed_call(text: str, body_start: int, tool_names: set[str] | None) -> tuple[str, str, int] | None:
    """A Hermes/Qwen block from ``body_start`` read as a stream reads it: (name, the arguments' text, where the block
    ends), or None when its head is not ``{"name": <a tool>, "arguments": {``."""
    m = CALL_HEAD.match(text, body_start)
    if m is None or text[m.end()] != "{":
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    if tool_names is not None and name not in tool_names:
        return None
    n, how = ArgsScanner().feed(text[m.end() :], final=True)
    after = m.end() + n
    if how == "tag":  # never closed: a closing tag ends the call, an opening one starts the next
        return name, text[m.end() : after], after + (len(HERMES_END) if text.startswith(HERMES_END, after) else 0)
    if how is None:  # never closed, to the end of the output
        return name, text[m.end() :], len(text)
    rest = text[after:]
    i = rest.find(HERMES_END)
    if i >= 0 and could_close(rest[: i + len(HERMES_END)]):
        return name, text[m.end() : after], after + i + len(HERMES_END)
    return name, text[m.end() : after], len(text) if could_close(rest) else after


def _json_end(text: str, body_start: int, end: int, marker: str) -> int:
    """The first ``marker`` after which the body parses as JSON, else ``end``: an argument string may contain the marker
    itself (a grammar-forced call admits any string, and a model writing about tool calls may quote the tag)."""
    candidate = end
    while candidate >= 0:
        try:
            json.loads(text[body_start:candidate])
            return candidate
        except (ValueError, RecursionError):
            candidate = text.find(marker, candidate + 1)
    return end


class Llama3Parser(ToolCallParser):
    name = "llama3"
    TAG = "<|python_tag|>"
    markers = (TAG,)
    forced = CallFormat(TAG, "parameters", "")
    _TRAILERS = ("<|eom_id|>", "<|eot_id|>")

    def detect(self, text: str) -> bool:
        return self.TAG in text or text.lstrip().startswith("{")

    def stream_hold_index(self, text: str) -> int:
        hold = super().stream_hold_index(text)
        stripped = text.lstrip()
        if stripped.startswith("{"):
            hold = min(hold, len(text) - len(stripped))
        return hold

    def parse(self, text: str, tool_names: set[str] | None = None) -> ParseResult:
        out = _Out(tool_names)
        tag = text.find(self.TAG)
        pre, body = (text[:tag], text[tag + len(self.TAG) :]) if tag >= 0 else ("", text)
        body = body.strip()
        for t in self._TRAILERS:
            body = body.removesuffix(t).rstrip()
        # Without the tag, require "parameters"/"arguments" so that a plain JSON
        # answer such as {"name": "Bob"} is not mistaken for a call.
        items = _scan_json(body, ";") if body.startswith("{") else None
        calls = [(_call_from_obj(v, require_args=tag < 0), raw) for v, raw in items or []]
        if not calls or any(c is None for c, _ in calls):
            out.text(text)
            return out.result()
        out.text(pre)
        rejected = [raw for c, raw in calls if c is not None and not out.call(*c)]
        if rejected:
            out.text((self.TAG if tag >= 0 else "") + "; ".join(rejected))
        return out.result()


class _JsonNames(ast.NodeTransformer):
    VALUES: ClassVar[dict[str, bool | None]] = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def _parse_call_list(src: str) -> list[tuple[str, dict[str, Any], str]] | None:
    """``[f(a=1), g(b='x')]`` -> [(name, kwargs, raw_call_text)], else None."""
    try:
        tree = ast.parse(src.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for elt in tree.body.elts:
        if not isinstance(elt, ast.Call) or elt.args or not (name := _dotted(elt.func)):
            return None
        args = {}
        for kw in elt.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(_JsonNames().visit(kw.value))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        calls.append((name, args, ast.get_source_segment(src.strip(), elt) or name))
    return calls


class PythonicParser(ToolCallParser):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    markers = (START,)
    _LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
    _LIST_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*(?:\(.*)?)?", re.DOTALL)

    def detect(self, text: str) -> bool:
        return self.START in text or bool(self._LIST_START.search(text))

    def stream_hold_index(self, text: str) -> int:
        hold = super().stream_hold_index(text)
        for m in re.finditer(r"\[", text[:hold]):
            if self._LIST_PREFIX.fullmatch(text, m.start()):
                return m.start()
        return hold

    def parse(self, text: str, tool_names: set[str] | None = None) -> ParseResult:
        out = _Out(tool_names)
        start = text.find(self.START)
        if start >= 0:
            rest = text[start + len(self.START) :]
            end = rest.find(self.END)
            body, post = (rest[:end], rest[end + len(self.END) :]) if end >= 0 else (rest, "")
            pre, calls = text[:start], _parse_call_list(body)
        else:
            pre, post, calls = text, "", None
            for m in self._LIST_START.finditer(text):
                if (calls := _parse_call_list(text[m.start() :])) is not None:
                    pre = text[: m.start()]
                    break
        if calls is None:
            out.text(text)
            return out.result()
        out.text(pre)
        rejected = [raw for name, args, raw in calls if not out.call(name, args)]
        if rejected:
            out.text("[" + ", ".join(rejected) + "]")
        out.text(post)
        return out.result()


class MistralParser(ToolCallParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"
    markers = (TAG,)
    _NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[ARGS\])?\s*")

    def parse(self, text: str, tool_names: set[str] | None = None) -> ParseResult:
        out = _Out(tool_names)
        first, *segments = text.split(self.TAG)
        out.text(first)
        for seg in segments:
            calls: list[tuple[tuple[str, dict[str, Any]] | None, str]] | None = None
            if seg.lstrip().startswith("["):  # [TOOL_CALLS] [{...}, {...}]
                items = _scan_json(seg.lstrip()[1:], ",", end="]")
                calls = [(_call_from_obj(v), raw) for v, raw in items or []]
            elif m := self._NAMED.match(seg):  # [TOOL_CALLS]name[ARGS]{...}
                try:
                    args, j = _DECODER.raw_decode(seg, m.end())
                except (ValueError, RecursionError):
                    args, j = None, 0
                if isinstance(args, dict) and not seg[j:].strip():
                    calls = [((m.group(1), args), seg)]
            if not calls or any(c is None for c, _ in calls):
                out.text(self.TAG + seg)
                continue
            rejected = [raw for c, raw in calls if c is not None and not out.call(*c)]
            if rejected and seg.lstrip().startswith("["):
                out.text(f"{self.TAG} [" + ", ".join(rejected) + "]")
            elif rejected:
                out.text(self.TAG + seg)
        return out.result()


PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen25": Qwen25Parser,
    "qwen": Qwen25Parser,
    "hermes": Qwen25Parser,
    "llama3": Llama3Parser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
}


def available_parsers() -> list[str]:
    return sorted(PARSERS)


def get_parser(name: str) -> ToolCallParser:
    cls = PARSERS.get(name.strip().lower()) if isinstance(name, str) else None
    if cls is None:
        raise UnknownToolParser(f"unknown tool-call parser {name!r}; known parsers: {', '.join(available_parsers())}")
    return cls()


def parser_for_model(model_type: str | None, chat_template: str | None) -> str:
    """Pick a default parser name from a model's config type and chat template."""
    template, mtype = chat_template or "", (model_type or "").lower()
    if "<|python_tag|>" in template:
        return "llama3"
    if "<|python_start|>" in template:  # Llama 4
        return "pythonic"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if mtype.startswith("llama") and "<|start_header_id|>" in template and "ipython" in template:
        return "llama3"  # Llama 3.2-style template: JSON calls, no python_tag in it
    return "qwen25"  # Hermes-style <tool_call> JSON, which loopwise renders when needed
