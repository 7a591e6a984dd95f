"""A request's JSON schema is checked off the event loop and bounded in size.

Checking a ``response_format`` schema or a tool's parameters against the JSON Schema meta-schema costs about half a millisecond per
``anyOf`` branch; it ran inside the request's validation on the event loop, so one 4 MB body of branches held
every other client for tens of seconds. Now a body over 8 KB is validated on a worker thread, and a schema of
more than ``MAX_SCHEMA_NODES`` objects and arrays is refused before the check.
"""

from __future__ import annotations

import threading
import time

import httpx

from runtime.api.openai_schemas import MAX_SCHEMA_NODES


def _any_of(branches: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(branches)]}


def _body(schema: dict) -> dict:
    """The schema as a tool's parameters (checked like a response_format schema, but compiled into no grammar)."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        "tool_choice": "none",
    }


def test_a_schema_over_the_node_limit_is_a_400(tiny_server):
    branches = MAX_SCHEMA_NODES // 3 + 1  # each branch: itself, its properties, one property, its required list
    r = httpx.post(tiny_server.url + "/chat/completions", json=_body(_any_of(branches)), timeout=60)
    assert r.status_code == 400, r.text
    assert str(MAX_SCHEMA_NODES) in r.json()["error"]["message"]


def test_the_event_loop_answers_while_a_large_schema_is_checked(tiny_server):
    """The large schema (4,000 branches, about two seconds of checking here) is in validation while /health is asked:
    /health answers first. Validated on the event loop, it would wait for the whole check."""
    done: dict[str, float] = {}

    def heavy() -> None:
        r = httpx.post(tiny_server.url + "/chat/completions", json=_body(_any_of(4000)), timeout=120)
        done["heavy"] = time.monotonic()
        done["status"] = r.status_code

    t = threading.Thread(target=heavy)
    t.start()
    time.sleep(0.3)  # the body (about 300 KB) is sent and its check has begun
    r = httpx.get(tiny_server.base_url + "/health", timeout=60)
    done["health"] = time.monotonic()
    t.join(120)
    assert r.status_code == 200
    assert done["status"] in (200, 400)  # a valid schema: answered, or refused as a prompt too long for the model; never a 5xx
    assert done["health"] < done["heavy"]
