"""Incremental detokenization with stop-string detection, one instance per request.

``TextStream.push(token_id)`` returns the text that became safe to show. Text is held back while it
ends in an incomplete UTF-8 sequence (the tokenizer decodes it to U+FFFD) or while its tail could
still turn into a stop string. When a stop string appears, the text before it is released and
``stopped`` holds the matched string; the stop string itself is never shown (OpenAI's behaviour).

Decoding uses a sliding window (vLLM's prefix/read offsets) so each push costs O(window), not
O(output length). Special tokens are skipped in text.

Not here: deciding when a token id ends generation (the scheduler does that) or tool-call parsing.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context kept so that merges and leading spaces decode correctly


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index are already in self._text
        self._text = ""  # all decoded text so far (stop string not yet cut)
        self._emitted = 0  # chars of self._text handed out
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """All text shown so far."""
        return self._text[: self._emitted]

    def push(self, token_id: int) -> str:
        if self.stopped is not None:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        full = self._decode(self._prefix, len(self._ids))
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix_text):
            return ""  # incomplete character, or a token with no visible text yet
        self._text += full[len(prefix_text) :]
        self._prefix = max(self._read, len(self._ids) - _WINDOW)
        self._read = len(self._ids)
        return self._release()

    def flush(self) -> str:
        """At the end of generation: release everything still held (except a matched stop string)."""
        out = ""
        if self.stopped is None:
            tail = self._decode(self._read, len(self._ids)) if self._read < len(self._ids) else ""
            self._text += tail
            self._read = len(self._ids)
            out = self._release()  # the held tail may complete a stop string; it must still be cut
        end = len(self._text)
        out += self._text[self._emitted : end]
        self._emitted = end
        return out

    def _release(self) -> str:
        if self._stop:
            search_from = max(0, self._emitted - self._max_stop)
            hits = [(i, s) for s in self._stop if (i := self._text.find(s, search_from)) != -1]
            if hits:
                pos, matched = min(hits)
                self.stopped = matched
                self._text = self._text[:pos]
                out = self._text[self._emitted :]
                self._emitted = len(self._text)
                return out
            end = len(self._text) - _partial_stop_len(self._text, self._stop, self._max_stop)
        else:
            end = len(self._text)
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        text: str = self._tok.decode(self._ids[start:end], skip_special_tokens=True)
        return text


def _partial_stop_len(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    for n in range(min(max_len - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
