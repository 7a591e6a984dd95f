"""Helpers shared by the HTTP-level tests: OpenAI clients, raw SSE parsing, /metrics parsing, error envelopes.

Every test that uses these drives a server on a real port (``tests/conftest.py``: ``serve.py``'s app in process, or the process); nothing here
imports the runtime.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai

MODEL = "tiny"
USER = [{"role": "user", "content": "Tell me something about the weather."}]


def client(server: Any, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=kw.pop("timeout", 60), **kw)


def aclient(server: Any, api_key: str = "unused", **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=kw.pop("timeout", 120), **kw)


def chat_body(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": USER}
    body.update(kw)
    return body


def post_chat(
    server: Any, body: Any = None, *, content: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 60
) -> httpx.Response:
    url = server.url + "/chat/completions"
    if content is not None:
        return httpx.post(url, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=timeout)
    return httpx.post(url, json=body, headers=headers, timeout=timeout)


class SSE:
    """A fully read ``text/event-stream`` response: the JSON events in order and whether ``[DONE]`` ended it."""

    def __init__(self, status: int, headers: httpx.Headers, raw: str) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw
        self.events: list[dict[str, Any]] = []
        self.done = False
        blocks = raw.split("\n\n")
        assert blocks[-1] == "", f"stream does not end with a blank line: {raw[-200:]!r}"
        for i, block in enumerate(blocks[:-1]):
            assert block.startswith("data: "), f"not an SSE data event: {block!r}"
            assert "\n" not in block, f"multi-line SSE event: {block!r}"
            payload = block[len("data: ") :]
            if payload == "[DONE]":
                assert i == len(blocks) - 2, "events after [DONE]"
                self.done = True
            else:
                self.events.append(json.loads(payload))

    def choice_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("choices")]

    def content(self, index: int = 0) -> str:
        return "".join(c["delta"].get("content") or "" for e in self.events for c in e.get("choices", []) if c["index"] == index)


def stream_chat(server: Any, body: dict[str, Any], timeout: float = 60) -> SSE:
    with (
        httpx.Client(timeout=timeout) as http,
        http.stream("POST", server.url + "/chat/completions", json={**body, "stream": True}) as r,
    ):
        raw = r.read().decode()
        return SSE(r.status_code, r.headers, raw)


def assert_error(resp: httpx.Response, status: int, *, type: str = "invalid_request_error", code: Any = ..., param: Any = ...) -> dict[str, Any]:
    """The response is ``status`` with exactly OpenAI's envelope; returns the inner error object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == type, err
    if code is not ...:
        assert err["code"] == code, err
    if param is not ...:
        assert err["param"] == param, err
    assert "Traceback" not in resp.text and 'File "' not in resp.text, resp.text
    return err


# ---- /metrics ------------------------------------------------------------------------------------

# label values are quoted and may hold braces (the endpoint label is a route template: "/admin/trajectories/{trajectory_id}")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)$')


def metrics(server: Any) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (labels exactly as rendered, ``name`` when none)."""
    r = httpx.get(server.base_url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparseable metrics line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_for_metric(server: Any, key: str, want: float, timeout: float = 10) -> float:
    """Poll ``/metrics`` until ``key`` equals ``want``; returns the seconds it took (raises on timeout)."""
    t0 = time.monotonic()
    value = None
    while time.monotonic() - t0 < timeout:
        value = metrics(server).get(key)
        if value == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{key} stayed {value}, wanted {want} within {timeout}s")
