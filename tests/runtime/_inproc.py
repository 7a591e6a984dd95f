"""In-process servers for HTTP tests: ``runtime.app.create_app`` around a scripted or tiny engine, with a real recorder.

``scripted_app(tokenizer, script, tmp)`` builds the app with :class:`tests.agents._scripted.ScriptedEngine`
(the fake sits at the engine edge only: its replies are tokenized with the real tokenizer; templating,
tool parsing and streaming, recording and the wire formats above it are the real ones) and a SQLite
store in ``tmp``. :class:`InProc` runs the app's lifespan and hands out a sync ``TestClient`` and an
``httpx.AsyncClient`` over ``ASGITransport``, so the real client packages can talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from learner.records.store import SqliteStore
from runtime.app import create_app
from runtime.recorder import Recorder
from runtime.settings import EngineSettings, RecorderSettings, ServerSettings
from tests.agents._scripted import Reply, ScriptedEngine


def scripted_app(
    tokenizer: Any, script: list[Reply | str] | Callable[..., Reply | str], tmp: Path, *, agents: Any = None, **server: Any
) -> tuple[Any, ScriptedEngine, SqliteStore]:
    engine = ScriptedEngine(tokenizer, script)
    engine.tokenizer = tokenizer  # type: ignore[attr-defined]  # the app reads the tokenizer off the engine
    store = SqliteStore(tmp / "interactions.db")
    recorder = Recorder(store, durability="sync", commit_window_s=0.001)
    app = create_app(
        ServerSettings(data_dir=tmp, **server),
        EngineSettings(),
        engine,  # type: ignore[arg-type]
        "tiny",
        recorder=recorder,
        recorder_settings=RecorderSettings(durability="sync"),
        agents=agents,
    )
    return app, engine, store


class InProc:
    """The app with its lifespan running on a private event loop thread; ``url`` for clients that take a base URL."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.client = TestClient(app)
        self.client.__enter__()
        self.base_url = "http://testserver"
        self.url = self.base_url + "/v1"

    def aclient(self) -> httpx.AsyncClient:
        """An async client into the app (the lifespan is already running through the TestClient)."""
        return httpx.AsyncClient(transport=_PortalTransport(self.client), base_url=self.base_url, timeout=60)

    def close(self) -> None:
        self.client.__exit__(None, None, None)


class _PortalTransport(httpx.AsyncBaseTransport):
    """Async requests served by the TestClient (its app runs in the TestClient's own event loop thread)."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.lock = threading.Lock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()

        def call() -> httpx.Response:
            r = self.client.request(request.method, str(request.url), content=body, headers=dict(request.headers))
            return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        return await asyncio.to_thread(call)
