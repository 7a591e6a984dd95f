"""Rows ↔ records for the interaction store: how a turn and a reward are laid out in a row, on either backend.

What it does: ``TURN_COLUMNS`` / ``REWARD_COLUMNS`` name the columns in row order; ``turn_row`` encodes a
``Turn`` as those values and ``turn_from_row`` / ``reward_from_row`` decode them. Token data is packed
little-endian arrays (``pack`` / ``unpack``: int32 ids, int8 loss mask, float32 logprobs), whatever the host's
byte order; messages, sampling, tool calls, timings and self-checks are compact JSON text (``encode_json``).
The same bytes go into SQLite ``BLOB`` and PostgreSQL ``BYTEA`` columns.

What it does not: talk to a database (``learner/records/store_sql.py`` holds the queries, ``learner/records/store.py`` and
``learner/records/store_pg.py`` the connections).
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from learner.records import Reward, ToolCallRecord, Turn, TurnCheck, TurnTimings

__all__ = [
    "N_TURN_COLUMNS",
    "REWARD_COLUMNS",
    "TURN_COLUMNS",
    "encode_json",
    "pack",
    "reward_from_row",
    "reward_row",
    "turn_from_row",
    "turn_row",
    "unpack",
]

_SWAP = sys.byteorder != "little"


def pack(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    """``values`` as a little-endian packed array of ``typecode`` (``i`` int32, ``b`` int8, ``f`` float32)."""
    a = array(typecode, values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack(typecode: str, blob: bytes | None) -> list[Any]:
    """The values of a packed array (an empty list for NULL or empty bytes)."""
    a = array(typecode)
    if blob:
        a.frombytes(blob)
        if _SWAP:
            a.byteswap()
    return a.tolist()


encode_json: Callable[[Any], str] = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # reused: no per-call setup


TURN_COLUMNS = (
    "turn_id, trajectory_id, session_id, idx, parent_turn_id, completion_id, choice_index, created_at, model, adapter, "
    "context_ids, output_ids, logprobs, loss_mask, sampling, tool_calls, finish_reason, timings, messages, output_text, "
    "continuation_key, prefix_key, owner, self_check"
)
N_TURN_COLUMNS = 24
REWARD_COLUMNS = "reward_id, target, target_id, value, source, created_at, comment, idempotency_key, owner"


def turn_row(t: Turn) -> tuple[Any, ...]:
    """A turn as the 24 values of ``TURN_COLUMNS``."""
    return (
        t.turn_id,
        t.trajectory_id,
        t.session_id,
        t.index,
        t.parent_turn_id,
        t.completion_id,
        t.choice_index,
        t.created_at,
        t.model,
        t.adapter,
        pack("i", t.context_ids),
        pack("i", t.output_ids),
        pack("f", t.logprobs),
        pack("b", t.loss_mask),
        encode_json(t.sampling),
        encode_json([tc.model_dump() for tc in t.tool_calls]),
        t.finish_reason,
        encode_json(t.timings.model_dump()),
        encode_json(t.messages),
        t.output_text,
        t.continuation_key,
        t.prefix_key,
        t.owner,
        None if t.self_check is None else encode_json(t.self_check.model_dump()),
    )


def turn_from_row(r: Sequence[Any]) -> Turn:
    """The turn a row of ``TURN_COLUMNS`` holds."""
    return Turn(
        turn_id=r[0],
        trajectory_id=r[1],
        session_id=r[2],
        index=r[3],
        parent_turn_id=r[4],
        completion_id=r[5],
        choice_index=r[6],
        created_at=r[7],
        model=r[8],
        adapter=r[9],
        context_ids=unpack("i", r[10]),
        output_ids=unpack("i", r[11]),
        logprobs=unpack("f", r[12]),
        loss_mask=unpack("b", r[13]),
        sampling=json.loads(r[14]),
        tool_calls=[ToolCallRecord(**tc) for tc in json.loads(r[15])],
        finish_reason=r[16],
        timings=TurnTimings(**json.loads(r[17])),
        messages=json.loads(r[18]),
        output_text=r[19],
        continuation_key=r[20],
        prefix_key=r[21],
        owner=r[22],
        self_check=None if r[23] is None else TurnCheck(**json.loads(r[23])),
    )


def reward_row(w: Reward) -> tuple[Any, ...]:
    """A reward as the 9 values of ``REWARD_COLUMNS``."""
    return (w.reward_id, w.target, w.target_id, w.value, w.source, w.created_at, w.comment, w.idempotency_key, w.owner)


def reward_from_row(r: Sequence[Any]) -> Reward:
    """The reward the first 9 values of a row (``REWARD_COLUMNS``) hold."""
    return Reward(
        reward_id=r[0], target=r[1], target_id=r[2], value=r[3], source=r[4], created_at=r[5], comment=r[6], idempotency_key=r[7], owner=r[8]
    )
