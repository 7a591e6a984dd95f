"""Feedback cannot steer learning beyond a key's own, honest say: reserved sources, bounded values, a rate limit.

A key once stored ``source: "verifier:calc_arith"`` (the source the learner's A/B experiments count) and a
reward of 1e300 on its turns.
"""

from __future__ import annotations

import pytest

from tests.security._app import ADMIN, KEY1, KEY2, auth, chat, served

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(params=[1000])
def app(request, tmp_path, tiny_model_path):
    from runtime.settings import FeedbackSettings

    with served(tmp_path, tiny_model_path, feedback=FeedbackSettings(max_abs_reward=10.0, per_minute=request.param)) as client:
        yield client


limited = pytest.mark.parametrize("app", [4], indirect=True)  # a budget of 4 feedback requests a minute


def _turn(app, key: str = KEY1) -> str:
    r = chat(app, key, HELLO)
    assert r.status_code == 200, r.text
    return r.json()["loopwise"]["turn_id"]


def _rewards(app) -> int:
    return app.get("/admin/stats", headers=auth(ADMIN)).json()["rewards"]


@pytest.mark.parametrize(
    "source", ["verifier:calc_arith", "judge:helpful", "hook:my_reward", "memory:feedback", "learner:hook:x", "VERIFIER:calc_arith", " verifier:x"]
)
def test_reserved_sources_are_refused(app, source):
    r = app.post("/v1/feedback", json={"turn_id": _turn(app), "reward": 1.0, "source": source}, headers=auth(KEY1))
    assert r.status_code in (400, 403), r.text
    err = r.json()["error"]
    assert err["param"] == "source"
    assert _rewards(app) == 0


def test_sources_are_plain_names(app):
    turn = _turn(app)
    for bad in ("has space", "new\nline", "x" * 201, ""):
        r = app.post("/v1/feedback", json={"turn_id": turn, "reward": 1.0, "source": bad}, headers=auth(KEY1))
        assert r.status_code == 400 and r.json()["error"]["param"] == "source", (bad, r.text)
    ok = app.post("/v1/feedback", json={"turn_id": turn, "reward": 1.0, "source": "thumbs:web-ui_v2"}, headers=auth(KEY1))
    assert ok.status_code == 200, ok.text


def test_rewards_are_finite_and_bounded(app):
    turn = _turn(app)
    for body in ({"reward": 1e300}, {"reward": -10.5}, {"reward": 1.0, "turn_rewards": {turn: 11.0}}):
        r = app.post("/v1/feedback", json={"turn_id": turn, **body}, headers=auth(KEY1))
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] in ("reward", "turn_rewards")
    assert _rewards(app) == 0
    assert app.post("/v1/feedback", json={"turn_id": turn, "reward": -10.0}, headers=auth(KEY1)).status_code == 200


@limited
def test_feedback_is_rate_limited_per_owner(app):
    t1, t2 = _turn(app, KEY1), _turn(app, KEY2)
    codes = [app.post("/v1/feedback", json={"turn_id": t1, "reward": 0.5}, headers=auth(KEY1)).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 200, 429]
    r = app.post("/v1/feedback", json={"turn_id": t1, "reward": 0.5}, headers=auth(KEY1))
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    # another key has its own budget
    assert app.post("/v1/feedback", json={"turn_id": t2, "reward": 0.5}, headers=auth(KEY2)).status_code == 200
