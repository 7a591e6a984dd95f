"""Startup moves the live heap out of the garbage collector's reach (``runtime.app.freeze_heap``): a full collection
then visits only what requests made since, not torch's, transformers' and the model's objects (it took ~250 ms with
the GIL held, a stall of every stream and the engine's steps)."""

from __future__ import annotations

import gc


def test_startup_freezes_the_heap_so_a_full_collection_skips_the_model(tiny_model_path):
    from fastapi.testclient import TestClient

    from runtime.app import create_app
    from runtime.engines.embedded import EmbeddedEngine
    from runtime.settings import EngineSettings, ServerSettings

    gc.unfreeze()
    try:
        engine = EmbeddedEngine(tiny_model_path, model_id="tiny", dtype="float32")
        app = create_app(ServerSettings(), EngineSettings(), engine, "tiny")
        assert gc.get_freeze_count() == 0
        with TestClient(app) as client:
            frozen = gc.get_freeze_count()
            assert frozen > 10_000, frozen
            tracked = {id(o) for o in gc.get_objects()}  # what a full collection visits
            assert id(engine) not in tracked and id(engine.model) not in tracked
            assert not any(id(m) in tracked for m in engine.model.modules())
            r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text  # and the server serves as before
        visited = len(gc.get_objects())
        gc.unfreeze()
        assert len(gc.get_objects()) >= visited + frozen // 2  # unfrozen, a full collection would visit them all again
    finally:
        gc.unfreeze()
