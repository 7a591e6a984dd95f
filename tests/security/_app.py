"""An in-process loopwise app for the trust tests: the tiny model, a real SQLite store, two user keys and an admin key.

``served(tmp_path, tiny_model_path)`` yields a ``fastapi.testclient.TestClient`` over ``runtime.app.create_app``
(the same app ``serve.py`` serves), so a test can act as several tenants without starting a process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KEY1, KEY2, ADMIN = "user-key-one", "user-key-two", "admin-key-secret"
MODEL = "tiny"


def auth(key: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **more}


@contextmanager
def served(
    tmp_path: Path,
    model_path: Path,
    *,
    server: dict[str, Any] | None = None,
    engine: Any = None,
    agents: Any = None,
    memory: Any = None,
    durability: str = "sync",
    feedback: Any = None,
    admission: Any = None,
) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from learner.records.store import SqliteStore
    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.recorder import Recorder
    from runtime.settings import EngineSettings, RecorderSettings, ServerSettings

    settings = ServerSettings(**{"data_dir": tmp_path, "api_keys": (KEY1, KEY2), "admin_key": ADMIN, **(server or {})})
    engine = engine or EmbeddedEngine(model_path, model_id=MODEL, dtype="float32")
    recorder = Recorder(SqliteStore(tmp_path / "interactions.db"), durability=durability)  # type: ignore[arg-type]
    app = create_app(
        settings,
        EngineSettings(),
        engine,
        MODEL,
        recorder=recorder,
        recorder_settings=RecorderSettings(durability=durability),  # type: ignore[arg-type]
        agents=agents,
        memory=memory,
        feedback_settings=feedback,
        admission_settings=admission,
    )
    with TestClient(app) as client:
        client.recorder = recorder  # type: ignore[attr-defined]
        yield client


def chat(client: Any, key: str, messages: list[dict[str, Any]], *, session: str | None = None, **kw: Any) -> Any:
    headers = auth(key, **({"X-Session-Id": session} if session else {}))
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body, headers=headers)
