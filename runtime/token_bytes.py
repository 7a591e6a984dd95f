"""The exact bytes each token id stands for, for OpenAI's ``logprobs[].bytes``.

Decoding one token alone turns a piece of a multi-byte character into U+FFFD, so its bytes would be
wrong. Byte-level BPE vocabularies (GPT-2 style, SmolLM2, Llama 3, Qwen) spell raw bytes with a fixed
byte→unicode table; SentencePiece vocabularies use ``▁`` for spaces and ``<0xNN>`` byte-fallback
pieces. Both are inverted here; any other vocabulary falls back to the UTF-8 of the decoded text.

Not here: detokenizing streams (``engines/textstream.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes_fn(tokenizer: Any) -> Callable[[int], bytes]:
    """A function from token id to its bytes, specialised to ``tokenizer``'s vocabulary style."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    byte_level = _is_byte_level(tokenizer)
    table = _unicode_to_byte()

    @cache
    def token_bytes(token_id: int) -> bytes:
        piece: str | None = tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or token_id in special:
            return (piece or "").encode()
        if byte_level:
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                return piece.encode()
        if m := _BYTE_PIECE.match(piece):
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:
            return piece.replace("▁", " ").encode()
        text: str = tokenizer.decode([token_id])
        return text.encode()

    return token_bytes
