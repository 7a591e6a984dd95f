"""Runtime test fixtures: one test suite, two backends.

``backend`` is a session fixture parametrized over ``embedded`` and ``sglang``. Tests of the chat,
streaming, tools, recording, adapter and hot-swap categories take ``served`` (a shared tiny-model
server on that backend, in process) or ``start_backend_server`` (a factory, like ``start_server``), so
each of them runs once per backend. For ``sglang``, the app of ``serve.py --backend sglang`` talks over HTTP to one
shared fake SGLang server (``tests/fakes/sglang_server.py``, backed by the embedded engine), started on
first use. Tests of engine-specific behaviour (batching metrics, queue overload, kill -9) keep using
``start_server``/``tiny_server`` and run on the embedded engine only.

Tests marked ``sglang`` (``tests/runtime/test_sglang_real.py``) need a real SGLang server instead; they
are deselected by default (``-m 'not gpu and not sglang'`` in pyproject) and run with ``-m sglang``
when ``LOOPWISE_SGLANG_URL`` is set, or under ``make test-engines`` against this machine's CPU server.

Real engines on this machine (vLLM's CPU build, SGLang's pure-PyTorch CPU path): ``make test-engines`` sets
``LOOPWISE_TEST_ENGINES`` to the engines it tests (``tests/runtime/_engines.py``); then ``backend`` is those
engines (``vllm``: one real vLLM server for the session, ``vllm_server``; ``sglang``: one real SGLang server,
``sglang_server``, in place of the fake) and only the backend-parametrized tests and those marked ``engines``
run; an engine whose virtualenv is missing is skipped with the reason, and so are the tests marked ``seeded`` on
real SGLang (its CPU path ignores seeds). In the default suite the ``engines``
tests are skipped with the reason (not installed, or left to ``make test-engines``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fakes.sglang_process import FakeSGLang
from tests.runtime import _sglang, _vllm
from tests.runtime._engines import ENGINES, asked
from tests.runtime._sglang import SGLangServer
from tests.runtime._vllm import VLLMServer

REAL_BACKENDS = tuple(e for e in ("vllm", "sglang") if asked(e))
BACKENDS = REAL_BACKENDS if ENGINES else ("embedded", "sglang")
SGLANG_SEEDS = (
    "SGLang 0.5.21 samples with a request's seed only under --enable-deterministic-inference, which needs a GPU attention "
    "backend: its CPU path ignores seeds (the fake honours them, as a GPU server run with that flag; test_sglang_contract.py)"
)

SGLANG_UTF8 = (
    "SGLang's grammar backend (xgrammar 0.2.9) lets a sampled string inside constrained JSON hold byte sequences that are "
    "not valid UTF-8 (seen about 1 call in 20 on the tiny model at T = 1); decoded they become U+FFFD and can break "
    "maxLength. The embedded engine's own mask refuses them; loopwise cannot re-sample inside an external engine"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINES:  # `make test-engines`: only what runs on real engines (and test_sglang_real.py, marked sglang)
        keep = [i for i in items if i.get_closest_marker("engines") or i.get_closest_marker("sglang") or _backend_of(i) in REAL_BACKENDS]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
        for item in keep:
            if item.get_closest_marker("seeded") and _backend_of(item) == "sglang":
                item.add_marker(pytest.mark.skip(reason=SGLANG_SEEDS))
            if item.get_closest_marker("utf8_strings") and _backend_of(item) == "sglang":
                item.add_marker(pytest.mark.xfail(reason=SGLANG_UTF8, strict=False))
    reasons = {"vllm": _vllm.skip_reason(), "sglang": _sglang.skip_reason()}
    for item in items:
        marker = item.get_closest_marker("engines")  # engines("sglang") names its engine; vLLM's tests name none
        reason = reasons[marker.args[0] if marker.args else "vllm"] if marker is not None else None
        if reason:  # not installed, left to `make test-engines`, or an engine it was not asked for
            item.add_marker(pytest.mark.skip(reason=reason))


def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None else None


@pytest.fixture(scope="session")
def first_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str, str], tuple[Path, dict[str, Any]]]]:
    """``first_start(spec, folder)`` → ``(cache, report)``: the first start of a serving process on an empty model cache
    (``tests/runtime/_first_start.py``), made once per spec for the whole run. It builds the model there (SmolLM2: its
    GGUF converted, ~12 s of CPU and ~540 MB); ``test_first_start.py`` compares a second start with it,
    ``test_model_store.py`` checks the folder it converted and ``test_smollm2_serving.py`` serves it where the model
    cache has no SmolLM2 of its own, so the suite converts SmolLM2 once.

    Once for the run, not per pytest-xdist worker: the first worker to ask builds it under a file lock in the run's
    shared temp folder (the parent of each worker's own) and writes its report beside it; the others read that. The
    caches stay until pytest's own retention of old runs removes them (another worker may still be reading one)."""
    from filelock import FileLock

    from tests.runtime._first_start import start

    root = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path_factory.getbasetemp()
    made: list[Path] = []

    def first(spec: str, folder: str) -> tuple[Path, dict[str, Any]]:
        cache, report = root / f"first-start-{spec}", root / f"first-start-{spec}.json"
        with FileLock(str(root / f"first-start-{spec}.lock")):
            if not report.exists():
                shutil.rmtree(cache, ignore_errors=True)  # a build interrupted in an earlier process of this run
                cache.mkdir()
                report.write_text(json.dumps(start(cache, spec, folder)))
                made.append(cache)
        return cache, json.loads(report.read_text())

    yield first
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: nobody else reads them
        for cache in made:
            shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_h32_path(model_cache: Path) -> Path:
    """The tiny model with head_dim 32 (vLLM's CPU attention needs it); same module shapes as ``tiny``."""
    from runtime.model_store import ensure_tiny

    return ensure_tiny(model_cache, head_dim=32)


@pytest.fixture(scope="session")
def vllm_server(tiny_h32_path: Path) -> Iterator[VLLMServer]:
    """One real vLLM server for the session (skipped when real engines do not run here)."""
    reason = _vllm.skip_reason()
    if reason:
        pytest.skip(reason)
    server = VLLMServer(tiny_h32_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_server(tiny_model_path: Path) -> Iterator[SGLangServer]:
    """One real SGLang server (CPU) for the session, on the tiny model (skipped when real engines do not run here)."""
    reason = _sglang.skip_reason()
    if reason:
        pytest.skip(reason)
    server = SGLangServer(tiny_model_path)
    yield server
    server.stop()


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
    """Like ``start_server``, on this session's ``backend`` (``--backend sglang --sglang-url <fake>`` for sglang, or
    ``<real SGLang>`` under ``make test-engines``; ``--backend vllm --engine-url <real vLLM>`` on the head_dim-32 tiny
    model for vllm)."""
    sglang: FakeSGLang | SGLangServer | None = None
    if backend == "sglang":
        sglang = request.getfixturevalue("sglang_server" if ENGINES else "fake_sglang")
    vllm: VLLMServer | None = request.getfixturevalue("vllm_server") if backend == "vllm" else None

    def start(*extra: str, **kw: Any) -> Any:
        if sglang is not None:
            extra = ("--backend", "sglang", "--sglang-url", sglang.url, *extra)
        if vllm is not None:
            extra = ("--backend", "vllm", "--engine-url", vllm.url, *extra)
            kw.setdefault("model", vllm.launcher.model_path)
        return start_server(*extra, **kw)

    return start


@pytest.fixture(scope="session")
def served_model_path(backend: str, request: pytest.FixtureRequest) -> Path:
    """The model folder ``start_backend_server``'s servers serve: on vllm the head_dim-32 tiny (its CPU attention needs
    it), else tiny; the reference the backend tests compare with."""
    path: Path = request.getfixturevalue("vllm_server").launcher.model_path if backend == "vllm" else request.getfixturevalue("tiny_model_path")
    return path


@pytest.fixture(scope="session")
def served(start_backend_server: Callable[..., Any]) -> Any:
    """The shared tiny-model server on each backend, for the read-only chat/streaming/tools tests."""
    return start_backend_server()


@pytest.fixture(scope="session")
def ctx_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with re-drawn weights (std 0.3 projections, std 1 embeddings): output depends on context."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ctx-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else 0.3))
    model.save_pretrained(out)
    for f in tiny_model_path.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out
