"""Token bytes for logprobs: the bytes of a text's tokens concatenate to the text's UTF-8, even when
a token holds only part of a multi-byte character."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from runtime.token_bytes import token_bytes_fn


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("text", ["plain ascii words", "naïve café 東京 🙂🎉", '{"city": "Zürich"}\n\ttabs'])
def test_token_bytes_concatenate_to_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    as_bytes = token_bytes_fn(tok)
    assert b"".join(as_bytes(i) for i in ids) == text.encode("utf-8")


def test_partial_character_tokens_have_their_real_bytes(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    as_bytes = token_bytes_fn(tok)
    pieces = [as_bytes(i) for i in ids]
    assert len(ids) > 1, "the tiny vocabulary should split the emoji into byte tokens"
    assert all(b"\xef\xbf\xbd" not in p for p in pieces)  # never the replacement character's bytes
    assert b"".join(pieces) == "🙂".encode()


def test_special_tokens_are_their_text(tok):
    as_bytes = token_bytes_fn(tok)
    assert as_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
