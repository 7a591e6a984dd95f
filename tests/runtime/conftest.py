"""Runtime test fixtures: one test suite, two backends.

``backend`` is a session fixture parametrized over ``embedded`` and ``sglang``. Tests of the chat,
streaming, tools, recording, adapter and hot-swap categories take ``served`` (a shared tiny-model
``serve.py`` on that backend) or ``start_backend_server`` (a factory, like ``start_server``), so each
of them runs once per backend. For ``sglang``, ``serve.py --backend sglang`` talks over HTTP to one
shared fake SGLang server (``tests/fakes/sglang_server.py``, backed by the embedded engine), started on
first use. Tests of engine-specific behaviour (batching metrics, queue overload, kill -9) keep using
``start_server``/``tiny_server`` and run on the embedded engine only.

Tests marked ``sglang`` (``tests/runtime/test_sglang_real.py``) need a real SGLang server instead; they
are deselected by default (``-m 'not gpu and not sglang'`` in pyproject) and run with ``-m sglang``
when ``LOOPWISE_SGLANG_URL`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.sglang_process import FakeSGLang

BACKENDS = ("embedded", "sglang")


@pytest.fixture(scope="session")
def fake_sglang(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeSGLang]:
    """One fake SGLang server for the whole session (LoRA on, 16 slots per batch, 64 loaded at most)."""
    fake = FakeSGLang(tiny_model_path, tmp_path_factory.mktemp("fake-sglang"))
    yield fake
    fake.stop()


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def start_backend_server(backend: str, start_server: Callable[..., Any], request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Like ``start_server``, on this session's ``backend`` (``--backend sglang --sglang-url <fake>`` for sglang)."""
    fake: FakeSGLang | None = request.getfixturevalue("fake_sglang") if backend == "sglang" else None

    def start(*extra: str, **kw: Any) -> Any:
        if fake is not None:
            extra = ("--backend", "sglang", "--sglang-url", fake.url, *extra)
        return start_server(*extra, **kw)

    return start


@pytest.fixture(scope="session")
def served(start_backend_server: Callable[..., Any]) -> Any:
    """The shared tiny-model server on each backend, for the read-only chat/streaming/tools tests."""
    return start_backend_server()
