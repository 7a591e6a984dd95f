"""runtime/engines/textstream.py: incremental detokenization and stop strings, with the tiny byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from runtime.engines.textstream import TextStream

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def ids_of(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(tok: Any, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[TextStream, list[str], str]:
    ts = TextStream(tok, stop)
    deltas = [ts.push(i) for i in ids]
    return ts, deltas, ts.flush()


UNICODE_CASES = [
    "Zürich 東京 😀🚀 Привет ½ — “quotes”",
    "a😀😀😀b",
    "東京東京東京東京東京東京東京東京 end",  # longer than the decode window, all multi-token characters
    "café naïve jalapeño مرحبا ✓ € £ °…",
]


@pytest.mark.parametrize("text", UNICODE_CASES)
def test_unicode_round_trip_token_by_token(tok: Any, text: str) -> None:
    ids = ids_of(tok, text)
    # the case really splits characters across tokens: some single token decodes to U+FFFD
    assert any(FFFD in tok.decode([i]) for i in ids)
    ts, deltas, tail = run(tok, ids)
    assert "".join(deltas) + tail == text
    assert tail == ""  # everything was complete by the last token
    for d in deltas:
        assert FFFD not in d
    assert ts.text == text
    assert ts.stopped is None


def test_incomplete_character_is_held_until_complete(tok: Any) -> None:
    ids = ids_of(tok, "Hello world 😀")
    assert tok.decode(ids[-2:-1]) == " " + FFFD  # ' ' + the first bytes of the emoji
    ts = TextStream(tok)
    out = [ts.push(i) for i in ids]
    assert out[:-2] == ["Hello", " w", "or", "l", "d"]
    assert out[-2] == ""  # held: it would end in U+FFFD
    assert out[-1] == " 😀"
    assert ts.flush() == ""


def test_incomplete_character_at_the_end_is_released_by_flush(tok: Any) -> None:
    ids = ids_of(tok, "Hello world 😀")[:-1]
    ts, deltas, tail = run(tok, ids)
    assert "".join(deltas) == "Hello world"
    assert tail == " " + FFFD


def test_stop_string_cuts_text_and_is_not_shown(tok: Any) -> None:
    ids = ids_of(tok, "Hello world. STOP here")
    ts = TextStream(tok, ("STOP",))
    released = ""
    for i in ids:
        released += ts.push(i)
        # what has been shown is always a prefix of the final text: never a partial "S"/"ST"/"STO" retracted later
        assert "Hello world. ".startswith(released)
    assert released == "Hello world. "
    assert ts.stopped == "STOP"
    assert ts.flush() == ""
    assert ts.text == "Hello world. "


def test_stop_prefix_is_held_while_it_can_still_match(tok: Any) -> None:
    ids = ids_of(tok, "Hello world. STOP here")
    ts = TextStream(tok, ("STOP",))
    out = [ts.push(i) for i in ids[:10]]  # up to and including 'O'
    assert out == ["Hello", " w", "or", "l", "d", ".", " ", "", "", ""]
    assert ts.stopped is None
    assert ts.push(ids[10]) == ""  # 'P' completes the stop string
    assert ts.stopped == "STOP"
    assert ts.push(ids[11]) == ""  # nothing after a stop


def test_partial_stop_that_does_not_match_is_released(tok: Any) -> None:
    ids = ids_of(tok, "Hello STAR")  # 'Hello', ' ', 'S', 'T', 'A', 'R'
    ts = TextStream(tok, ("STOP",))
    out = [ts.push(i) for i in ids]
    assert out == ["Hello", " ", "", "", "STA", "R"]
    assert ts.stopped is None
    assert ts.flush() == ""


def test_partial_stop_at_the_end_is_released_by_flush(tok: Any) -> None:
    ts, deltas, tail = run(tok, ids_of(tok, "Hello ST"), stop=("STOP",))
    assert "".join(deltas) == "Hello "
    assert tail == "ST"
    assert ts.stopped is None
    assert ts.text == "Hello ST"


def test_earliest_of_several_stop_strings_wins(tok: Any) -> None:
    (hello,) = ids_of(tok, "Hello")  # one token: both stop strings appear in the same push
    ts = TextStream(tok, ("lo", "el"))
    assert ts.push(hello) == "H"
    assert ts.stopped == "el"


def test_earliest_stop_across_tokens(tok: Any) -> None:
    ts, deltas, tail = run(tok, ids_of(tok, "one two. three\n\nfour"), stop=("four", "\n\n", "three"))
    assert "".join(deltas) + tail == "one two. "
    assert ts.stopped == "three"


def test_multi_token_stop_string_with_newlines(tok: Any) -> None:
    ts, deltas, tail = run(tok, ids_of(tok, "one two. three\n\nfour"), stop=("\n\n",))
    assert "".join(deltas) == "one two. three"
    assert tail == ""
    assert ts.stopped == "\n\n"


def test_stop_string_completed_by_a_held_tail_is_still_cut_at_flush(tok: Any) -> None:
    # 'd', then ' ' + the first bytes of an emoji (held as incomplete); generation ends there
    ids = ids_of(tok, "Hello world 😀")[:-1]
    ts, deltas, tail = run(tok, ids, stop=("d ",))
    assert "".join(deltas) + tail == "Hello worl"
    assert ts.stopped == "d "


def test_special_tokens_are_skipped(tok: Any) -> None:
    ids = [1, *ids_of(tok, "assistant\nhi"), 2]  # <|im_start|> ... <|im_end|>
    ts, deltas, tail = run(tok, ids)
    assert "".join(deltas) + tail == "assistant\nhi"
