"""Every record has an owner (the API key's identity): no key rewards, continues or deletes another's data.

Each test acts as two tenants (two user keys) and the admin on one in-process app with a real SQLite store.
"""

from __future__ import annotations

import pytest

from tests.security._app import ADMIN, KEY1, KEY2, auth, chat, served

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def app(tmp_path, tiny_model_path):
    with served(tmp_path, tiny_model_path) as client:
        yield client


def _ids(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["loopwise"]


def _reward_count(app) -> int:
    return app.get("/admin/stats", headers=auth(ADMIN)).json()["rewards"]


def test_a_key_cannot_reward_another_keys_turn_trajectory_or_completion(app):
    r = chat(app, KEY1, HELLO)
    ids, completion = _ids(r), r.json()["id"]
    for body in (
        {"turn_id": ids["turn_id"], "reward": 1.0},
        {"trajectory_id": ids["trajectory_id"], "reward": 1.0},
        {"completion_id": completion, "reward": 1.0},
        {"turn_rewards": {ids["turn_id"]: 1.0}},
    ):
        r = app.post("/v1/feedback", json=body, headers=auth(KEY2))
        assert r.status_code == 404, (body, r.text)  # indistinguishable from an unknown id
        assert r.json()["error"]["code"] == "not_found"
    assert _reward_count(app) == 0
    # the owner itself can
    r = app.post("/v1/feedback", json={"turn_id": ids["turn_id"], "reward": 1.0}, headers=auth(KEY1))
    assert r.status_code == 200, r.text
    assert _reward_count(app) == 1


def test_idempotency_keys_are_per_owner(app):
    own1, own2 = _ids(chat(app, KEY1, HELLO)), _ids(chat(app, KEY2, HELLO))
    r2 = app.post("/v1/feedback", json={"turn_id": own2["turn_id"], "reward": 0.0, "idempotency_key": "k-1"}, headers=auth(KEY2))
    assert r2.status_code == 200 and r2.json()["duplicate"] is False
    r1 = app.post("/v1/feedback", json={"turn_id": own1["turn_id"], "reward": 1.0, "idempotency_key": "k-1"}, headers=auth(KEY1))
    assert r1.status_code == 200, r1.text
    assert r1.json()["duplicate"] is False  # key 2's claim of "k-1" does not swallow key 1's feedback
    assert r1.json()["rewards"][0]["target_id"] == own1["turn_id"]
    again = app.post("/v1/feedback", json={"turn_id": own1["turn_id"], "reward": 0.5, "idempotency_key": "k-1"}, headers=auth(KEY1))
    assert again.json()["duplicate"] is True and again.json()["rewards"][0]["value"] == 1.0
    traj = app.get(f"/admin/trajectories/{own1['trajectory_id']}", headers=auth(ADMIN)).json()
    assert [r["value"] for r in traj["rewards"]] == [1.0]


def test_the_admins_idempotency_keys_do_not_swallow_the_tenants_feedback(app):
    """An admin's reward is stored as the tenant's (it rewards the tenant's turn), so it shared the tenant's idempotency
    keys: the tenant's own feedback under a key the admin had used came back ``duplicate`` with the admin's reward."""
    t1, t2 = _ids(chat(app, KEY1, HELLO)), _ids(chat(app, KEY1, HELLO))
    r = app.post("/admin/feedback", json={"turn_id": t1["turn_id"], "reward": 0.0, "idempotency_key": "k"}, headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["duplicate"] is False, r.text
    own = app.post("/v1/feedback", json={"turn_id": t2["turn_id"], "reward": 1.0, "idempotency_key": "k"}, headers=auth(KEY1))
    assert own.status_code == 200 and own.json()["duplicate"] is False, own.text
    assert own.json()["rewards"][0]["target_id"] == t2["turn_id"] and own.json()["rewards"][0]["value"] == 1.0
    again = app.post("/admin/feedback", json={"turn_id": t1["turn_id"], "reward": 0.5, "idempotency_key": "k"}, headers=auth(ADMIN))
    assert again.json()["duplicate"] is True  # the admin's own retry is still recognised
    assert _reward_count(app) == 2


def test_a_key_does_not_continue_another_keys_trajectory(app):
    r = chat(app, KEY1, HELLO, session="alice")
    first = _ids(r)
    reply = r.json()["choices"][0]["message"]["content"]
    follow = [*HELLO, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    other = _ids(chat(app, KEY2, follow, session="alice"))  # same session name, same history: another tenant
    assert other["trajectory_id"] != first["trajectory_id"]
    turn = app.get(f"/admin/trajectories/{other['trajectory_id']}", headers=auth(ADMIN)).json()["turns"][0]
    assert turn["index"] == 0 and turn["parent_turn_id"] is None
    own = _ids(chat(app, KEY1, follow, session="alice"))  # the owner continues its own
    assert own["trajectory_id"] == first["trajectory_id"]


def test_trajectories_carry_their_owner(app):
    ids = _ids(chat(app, KEY1, HELLO))
    traj = app.get(f"/admin/trajectories/{ids['trajectory_id']}", headers=auth(ADMIN)).json()
    from runtime.identity import owner_of_token

    assert traj["owner"] == owner_of_token(KEY1) and traj["turns"][0]["owner"] == owner_of_token(KEY1)
    listed = app.get("/admin/trajectories", params={"owner": owner_of_token(KEY2)}, headers=auth(ADMIN)).json()["data"]
    assert listed == []


def test_session_deletion_is_scoped_by_owner(app):
    from runtime.identity import owner_of_token

    a1 = _ids(chat(app, KEY1, HELLO, session="alice"))
    a2 = _ids(chat(app, KEY2, HELLO, session="alice"))
    # the admin must say whose "alice" when two owners have one
    r = app.delete("/admin/sessions/alice", headers=auth(ADMIN))
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "ambiguous_owner"
    r = app.delete("/admin/sessions/alice", params={"owner": owner_of_token(KEY2)}, headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["deleted_turns"] == 1
    assert app.get(f"/admin/trajectories/{a2['trajectory_id']}", headers=auth(ADMIN)).status_code == 404
    assert app.get(f"/admin/trajectories/{a1['trajectory_id']}", headers=auth(ADMIN)).status_code == 200
    # a key deletes its own session (and only its own)
    _ids(chat(app, KEY2, HELLO, session="bob"))
    r = app.delete("/v1/sessions/alice", headers=auth(KEY2))
    assert r.status_code == 404  # key 2 has no "alice" any more; key 1's is not reachable
    r = app.delete("/v1/sessions/alice", headers=auth(KEY1))
    assert r.status_code == 200 and r.json()["deleted_turns"] == 1
    assert app.get(f"/admin/trajectories/{a1['trajectory_id']}", headers=auth(ADMIN)).status_code == 404


def test_the_admin_rewards_any_owners_turn_through_the_admin_api(app):
    from runtime.identity import owner_of_token

    ids = _ids(chat(app, KEY1, HELLO))
    assert app.post("/v1/feedback", json={"turn_id": ids["turn_id"], "reward": 1.0}, headers=auth(ADMIN)).status_code == 401
    r = app.post("/admin/feedback", json={"turn_id": ids["turn_id"], "reward": 0.5, "source": "console"}, headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    assert app.post("/admin/feedback", json={"turn_id": ids["turn_id"], "reward": 0.5}, headers=auth(KEY1)).status_code == 401
    traj = app.get(f"/admin/trajectories/{ids['trajectory_id']}", headers=auth(ADMIN)).json()
    assert [(r["value"], r["owner"]) for r in traj["rewards"]] == [(0.5, owner_of_token(KEY1))]  # the target's owner's reward
