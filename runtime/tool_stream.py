"""Tool calls out of a token stream: content until a call starts, then the call's name and its arguments as they decode.

:class:`ToolCallStreamer` is fed the text of one choice as it arrives and returns pieces:
``("text", s)`` (content safe to show), ``("start", k, call_id, name)`` and ``("args", k, delta)``
(the ``k``-th call's arguments text, in order; the deltas joined are the call's ``arguments``).

For the Hermes/Qwen2.5 format (parsers ``qwen25``, ``hermes``, ``qwen``; what loopwise renders for
templates without a tool section) calls stream incrementally: once ``<tool_call>`` and the
``{"name": "...", "arguments": `` head are decoded and the name is one of the request's tools, the
call starts, and every later character of the arguments object is sent as it arrives (a JSON scanner,
``tool_parsers.ArgsScanner``, tracks strings and nesting to find where the object ends; an object that
never closes ends where a ``<tool_call>`` / ``</tool_call>`` tag starts outside a string). The arguments
are the model's own text, which under a forced tool choice is compact JSON that the grammar guarantees
to match the schema; under ``auto`` it is whatever the model wrote, valid JSON or not (the parser reads
a complete output the same way, so a streamed answer and a non-streamed one agree: ``tool_parsers``).
For the other formats (``llama3``, ``pythonic``, ``mistral``) the text from the first possible
call marker is held back and parsed when the choice ends, then sent as one delta per call.

A call that has started stays a call: if the model stops inside the arguments (``length``), the
arguments are what it produced, as OpenAI streams them. A forced call (``forced_names``: the output
is one grammar-forced call) cut before its arguments began, or in a format that is held, is read at
the end with the parser's ``parse_cut``: a call with the arguments so far, never markup as content.
Text the model writes between or after calls is sent as content when the choice ends.

Not here: parsing complete outputs (``tool_parsers``), or any wire format.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.tool_parsers import CALL_HEAD, HERMES_END, ArgsScanner, ParsedToolCall, ToolCallParser, could_close, new_call_id

_INCREMENTAL = {"qwen25"}  # parser class names whose calls stream incrementally
_MAX_HEAD = 512  # a call head longer than this is not one: hold the rest and parse it at the end


class ToolCallStreamer:
    def __init__(self, parser: ToolCallParser, tool_names: set[str], forced_names: set[str] | None = None) -> None:
        self.parser = parser
        self.names = tool_names
        self.forced_names = forced_names  # the output is one forced call to one of these (None: not forced)
        self.incremental = parser.name in _INCREMENTAL
        self.mode = "text"  # text | head | args | tail | held
        self.buf = ""  # text not yet consumed in the current mode
        self.shown: list[str] = []  # content sent
        self.after: list[str] = []  # content between/after calls, sent at the end
        self.held = ""  # text from a call marker on that is parsed when the choice ends
        self._calls: list[list[str]] = []  # [id, name, arguments]
        self._scanner = ArgsScanner()

    # ---- feeding
    def feed(self, text: str) -> list[tuple[Any, ...]]:
        self.buf += text
        out: list[tuple[Any, ...]] = []
        progressed = True
        while progressed:
            progressed = getattr(self, f"_{self.mode}")(out)
        return out

    def finish(self, cut: bool = False) -> list[tuple[Any, ...]]:
        """The choice ended (``cut``: by the token limit): flush what is held (parsing held text for calls)."""
        if cut and self.forced_names is not None and not self._calls and self.mode != "done":
            return self._finish_cut()
        out: list[tuple[Any, ...]] = []
        rest, self.buf = self.buf, ""
        if self.mode in ("held", "head"):
            rest = self.held + rest if self.mode == "held" else self.parser.markers[0] + rest
            parsed = self.parser.parse(rest, self.names)
            self.after.append(parsed.content or "" if parsed.tool_calls else rest)
            for c in parsed.tool_calls:
                k = len(self._calls)
                self._calls.append([c.id, c.name, c.arguments])
                out += [("start", k, c.id, c.name), ("args", k, c.arguments)]
        elif self.mode == "text":
            self.after.append(rest)
        elif self.mode in ("tail", "args"):
            if self.mode == "args":  # never closed: the arguments run to the end (a held-back "<…" included)
                self._emit_args(rest, out)
            elif not could_close(rest):
                self.after.append(rest)
        text = "".join(self.after)
        if self._calls:
            text = text.strip()
        if text and (text.strip() or not self._calls):
            out.insert(0, ("text", text))
            self.shown.append(text)
        self.mode = "done"
        return out

    def _finish_cut(self) -> list[tuple[Any, ...]]:
        """A forced call cut before it started streaming: the call as far as it goes, and no content."""
        pending = {"held": self.held, "head": self.parser.markers[0]}.get(self.mode, "") + self.buf
        self.buf, self.mode = "", "done"
        out: list[tuple[Any, ...]] = []
        for c in self.parser.parse_cut("".join(self.shown) + pending, self.forced_names or set()).tool_calls:
            k = len(self._calls)
            self._calls.append([c.id, c.name, ""])
            out.append(("start", k, c.id, c.name))
            self._emit_args(c.arguments, out)
        return out

    # ---- results
    def calls(self) -> list[ParsedToolCall]:
        return [ParsedToolCall(name=name, arguments=args, id=cid) for cid, name, args in self._calls]

    def content(self) -> str | None:
        text = "".join(self.shown)
        return text if text or not self._calls else None

    # ---- modes (each returns whether it consumed something and another mode should look)
    def _text(self, out: list[tuple[Any, ...]]) -> bool:
        if self._calls:  # text after a finished call: kept for the end
            start = self.buf.find(self.parser.markers[0]) if self.incremental else -1
            if start < 0:
                hold = self.parser.stream_hold_index(self.buf) if self.incremental else len(self.buf)
                self.after.append(self.buf[:hold])
                self.buf = self.buf[hold:]
                return False
            self.after.append(self.buf[:start])
            self.buf = self.buf[start + len(self.parser.markers[0]) :]
            self.mode = "head"
            return True
        upto = self.parser.stream_hold_index(self.buf)
        if upto > 0:
            out.append(("text", self.buf[:upto]))
            self.shown.append(self.buf[:upto])
            self.buf = self.buf[upto:]
        if upto < len(self.buf) and self.parser.detect(self.buf):
            if self.incremental and self.buf.startswith(self.parser.markers[0]):
                self.buf = self.buf[len(self.parser.markers[0]) :]
                self.mode = "head"
            else:
                self.held, self.buf = self.buf, ""
                self.mode = "held"
            return True
        return False

    def _held(self, out: list[tuple[Any, ...]]) -> bool:
        self.held += self.buf
        self.buf = ""
        return False

    def _head(self, out: list[tuple[Any, ...]]) -> bool:
        m = CALL_HEAD.match(self.buf)
        if m is None:
            if len(self.buf) > _MAX_HEAD or (self.buf.strip() and not self.buf.lstrip().startswith("{")):
                return self._give_up()
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return self._give_up()
        if name not in self.names or self.buf[m.end()] != "{":
            return self._give_up()
        k = len(self._calls)
        call_id = new_call_id()
        self._calls.append([call_id, name, ""])
        out.append(("start", k, call_id, name))
        self.buf = self.buf[m.end() :]
        self._scanner = ArgsScanner()
        self.mode = "args"
        return True

    def _give_up(self) -> bool:
        """Not a call head we can stream: hold everything from the marker and parse it at the end."""
        self.held = self.parser.markers[0] + self.buf
        self.buf = ""
        self.mode = "held"
        return False

    def _args(self, out: list[tuple[Any, ...]]) -> bool:
        n, how = self._scanner.feed(self.buf)
        self._emit_args(self.buf[:n], out)
        self.buf = self.buf[n:]
        if how == "closed":
            self.mode = "tail"
            return True
        if how == "tag":  # the object never closed: a closing tag ends the call, an opening one starts the next
            if self.buf.startswith(HERMES_END):
                self.buf = self.buf[len(HERMES_END) :]
            self.mode = "text"
            return True
        return False

    def _emit_args(self, piece: str, out: list[tuple[Any, ...]]) -> None:
        if piece:
            k = len(self._calls) - 1
            self._calls[k][2] += piece
            out.append(("args", k, piece))

    def _tail(self, out: list[tuple[Any, ...]]) -> bool:
        """After the arguments: ``}`` and ``</tool_call>`` close the call; anything else is content (read as text)."""
        i = self.buf.find(HERMES_END)
        if i >= 0 and could_close(self.buf[: i + len(HERMES_END)]):
            self.buf = self.buf[i + len(HERMES_END) :]
            self.mode = "text"
            return True
        if not could_close(self.buf):
            self.mode = "text"
            return True
        return False

    def _done(self, out: list[tuple[Any, ...]]) -> bool:
        return False
