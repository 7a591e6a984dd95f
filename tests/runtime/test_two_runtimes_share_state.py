"""Two runtimes (``serve.build`` behind uvicorn, the tiny model, two API keys) on one PostgreSQL store share what a
user can see besides turns (issue 42, item 5):

- a stored ``/v1/responses`` response made on one runtime is read, continued (``previous_response_id``) and deleted on
  the other, and never by another key;
- agent memory is one set of documents: what one runtime holds the other lists and serves, a deletion on one is gone
  on both, another key reaches none of it;
- one turn is continued once: the same conversation continued on both runtimes at the same moment extends its
  trajectory once, the other request opens a branch from the same turn;
- and an unreachable store stops ``serve.py``'s composition within seconds, naming the host, before the model loads.

Before: responses and memory were files in each runtime's data folder (the other runtime answered 404), and both
continuations extended the one trajectory.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.identity import owner_of_token

KEY1, KEY2, ADMIN = "share-key-one", "share-key-two", "share-admin"
OWNER1 = owner_of_token(KEY1)


def auth(key: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **more}


@pytest.fixture(scope="module")
def two(start_server: Any, pg_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    url = pg_cluster.create_schema(f"share_{time.monotonic_ns() % 10**9}")
    args = ("--store", url, "--durability", "sync", "--api-key", KEY1, "--api-key", KEY2, "--admin-key", ADMIN)
    a = start_server(*args, data_dir=tmp_path_factory.mktemp("share-a"))
    b = start_server(*args, data_dir=tmp_path_factory.mktemp("share-b"))
    return url, a, b


def test_stored_responses_are_shared_and_stay_the_keys_own(two: tuple[str, Any, Any]) -> None:
    _, a, b = two
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 3, "temperature": 0}
    r = httpx.post(a.url + "/responses", json=body, headers=auth(KEY1), timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    got = httpx.get(f"{b.url}/responses/{rid}", headers=auth(KEY1), timeout=60)
    assert got.status_code == 200 and got.json()["id"] == rid
    assert httpx.get(f"{b.url}/responses/{rid}", headers=auth(KEY2), timeout=60).status_code == 404
    more = {**body, "input": "more", "previous_response_id": rid}
    assert httpx.post(b.url + "/responses", json=more, headers=auth(KEY2), timeout=60).status_code == 404
    cont = httpx.post(b.url + "/responses", json=more, headers=auth(KEY1), timeout=60)
    assert cont.status_code == 200, cont.text
    assert cont.json()["loopwise"]["trajectory_id"] == r.json()["loopwise"]["trajectory_id"]  # continued across runtimes
    assert httpx.delete(f"{b.url}/responses/{rid}", headers=auth(KEY2), timeout=60).status_code == 404
    assert httpx.delete(f"{b.url}/responses/{rid}", headers=auth(KEY1), timeout=60).status_code == 200
    assert httpx.get(f"{a.url}/responses/{rid}", headers=auth(KEY1), timeout=60).status_code == 404


def test_agent_memory_is_one_set_of_documents(two: tuple[str, Any, Any]) -> None:
    from learner.records.store_pg import PostgresStore
    from memory.store import Provenance
    from memory.store_pg import PostgresMemoryStore

    url, a, b = two
    db = PostgresStore(url, max_size=1)
    try:
        PostgresMemoryStore(db).write(OWNER1, "user:carol", "carol likes rock", Provenance("memopilot"))  # as a rewrite on a third runtime
    finally:
        db.close()
    for server in (a, b):
        doc = httpx.get(server.url + "/memory/user:carol", headers=auth(KEY1), timeout=60)
        assert doc.status_code == 200 and doc.json()["text"] == "carol likes rock"
        assert [d["scope"] for d in httpx.get(server.url + "/memory", headers=auth(KEY1), timeout=60).json()["data"]] == ["user:carol"]
        assert httpx.get(server.url + "/memory/user:carol", headers=auth(KEY2), timeout=60).status_code == 404
    assert httpx.delete(b.url + "/memory/user:carol", headers=auth(KEY2), timeout=60).status_code == 404
    assert httpx.delete(b.url + "/memory/user:carol", headers=auth(KEY1), timeout=60).status_code == 200
    assert httpx.get(a.url + "/memory/user:carol", headers=auth(KEY1), timeout=60).status_code == 404


def test_one_turn_continued_on_both_runtimes_at_once_extends_its_trajectory_once(two: tuple[str, Any, Any]) -> None:
    _, a, b = two
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]

    def chat(server: Any, msgs: list[dict[str, Any]]) -> httpx.Response:
        body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/chat/completions", json=body, headers=auth(KEY1, **{"X-Session-Id": "race"}), timeout=60)
        assert r.status_code == 200, r.text
        return r

    first = chat(a, messages).json()
    nxt = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}, {"role": "user", "content": "and?"}]
    for _ in range(3):  # a few rounds: the two requests reach their runtimes in either order
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = [f.result().json()["loopwise"] for f in [pool.submit(chat, server, nxt) for server in (a, b)]]
        trajectories = [x["trajectory_id"] for x in replies]
        assert trajectories.count(first["loopwise"]["trajectory_id"]) <= 1
    # over all rounds the first turn was continued in its own trajectory once; every other continuation is a branch
    r = httpx.get(f"{a.base_url}/admin/trajectories/{first['loopwise']['trajectory_id']}", headers=auth(ADMIN), timeout=60)
    assert [t["index"] for t in r.json()["turns"]] == [0, 1]


@pytest.fixture
def silent_port() -> Any:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # takes connections, never answers
        yield sock.getsockname()[1]


def test_serve_stops_within_seconds_on_an_unreachable_store(silent_port: int, tiny_model_path: Path, tmp_path: Path) -> None:
    import serve

    url = f"postgresql://loopwise:hunter2@127.0.0.1:{silent_port}/db"
    settings = serve.settings_from_args(["--model", str(tiny_model_path), "--data-dir", str(tmp_path), "--no-learner", "--store", url])
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        serve.build(settings)
    elapsed = time.monotonic() - start
    message = str(exit_.value.code)
    assert elapsed < 6, f"took {elapsed:.1f} s"
    assert message.startswith(f"error: cannot reach the PostgreSQL store at 127.0.0.1:{silent_port}") and "hunter2" not in message, message
