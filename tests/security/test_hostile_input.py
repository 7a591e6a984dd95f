"""Hostile request details answer 400 and cost the server nothing lasting: deep JSON, huge ``user`` and session
names, made-up paths (Prometheus label cardinality), hostile request ids, underflowing temperatures."""

from __future__ import annotations

import re

import pytest

from tests.security._app import ADMIN, KEY1, auth, chat, served

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture
def app(tmp_path, tiny_model_path):
    with served(tmp_path, tiny_model_path) as client:
        yield client


def test_deeply_nested_json_is_a_400(app):
    for depth in (200, 5000, 100_000):
        raw = '{"model": "tiny", "messages": ' + "[" * depth + "]" * depth + "}"
        r = app.post("/v1/chat/completions", content=raw, headers={**auth(KEY1), "content-type": "application/json"})
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "invalid_json"
    deep_schema = {"type": "object"}
    for _ in range(300):
        deep_schema = {"type": "object", "properties": {"x": deep_schema}}
    body = {"model": "tiny", "messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema}}}
    r = app.post("/v1/chat/completions", json=body, headers=auth(KEY1))
    assert r.status_code == 400, r.text[:300]


def test_user_and_session_names_are_bounded(app):
    r = chat(app, KEY1, HELLO, user="u" * 100_000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text[:200]
    r = chat(app, KEY1, HELLO, session="s" * 10_000)
    assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"], r.text[:200]
    r = app.post("/v1/agents/none/runs", json={"input": "x", "user": "u" * 100_000}, headers=auth(KEY1))
    assert r.status_code in (400, 404)
    assert chat(app, KEY1, HELLO, user="alice", session="a-session_1").status_code == 200


def test_unknown_paths_do_not_become_metric_labels(app):
    for i in range(30):
        if i < 15:  # a key's 20th refusal in a minute throttles it (tests/security/test_throttle.py); 15 paths make the point
            app.get(f"/v1/made-up-{i}", headers=auth(KEY1))
        app.get(f"/nothing/here/{i}")
    text = app.get("/metrics").text
    labels = set(re.findall(r'loopwise_requests_total\{endpoint="([^"]*)"', text))
    assert not any("made-up" in x or "nothing" in x for x in labels), labels
    assert len(labels) < 10, labels


def test_a_hostile_request_id_is_replaced(app):
    for rid in ("x" * 5000, "bad id\nwith newline", "<script>"):
        r = app.get("/health", headers={"X-Request-Id": rid})
        assert r.headers["x-request-id"] != rid and re.fullmatch(r"[A-Za-z0-9._-]{1,128}", r.headers["x-request-id"])
    r = app.get("/health", headers={"X-Request-Id": "client-rid-42"})
    assert r.headers["x-request-id"] == "client-rid-42"  # a plain id is kept (clients correlate logs by it)


def test_an_underflowing_temperature_is_recorded_as_greedy(app):
    r = chat(app, KEY1, HELLO, temperature=1e-50, logprobs=True)
    assert r.status_code == 200, r.text
    traj = app.get(f"/admin/trajectories/{r.json()['loopwise']['trajectory_id']}", headers=auth(ADMIN)).json()
    assert traj["turns"][0]["sampling"]["temperature"] == 0.0  # a learner dividing by 1e-50 would get inf


def test_top_logprobs_under_a_grammar_are_valid_json(app):
    import json as _json

    fmt = {"type": "json_object"}
    for stream in (False, True):
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "logprobs": True, "top_logprobs": 20, "response_format": fmt, "stream": stream}
        r = app.post("/v1/chat/completions", json=body, headers=auth(KEY1))
        assert r.status_code == 200, r.text[:300]
        assert "Infinity" not in r.text and "NaN" not in r.text
        payloads = [r.text] if not stream else [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
        for p in payloads:
            _json.loads(p, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict JSON
