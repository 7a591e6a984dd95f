"""A recorded turn's path through the learner reads straight: no learner module calls back into one that called it.

The path was once a back-and-forth between the rollout, re-rollout, advantages and samples modules (planning
helpers in ``advantages.py`` that ``rerollout.py`` imported back, a converter apart from its type). This traces
one real update (``LearnerService.update``: two-turn chats and an ``n`` = 2 group recorded through the app,
rated through ``POST /v1/feedback``, stepped by a ``LoRATrainer`` on the tiny model) with ``sys.setprofile`` and
collects which learner module calls which (a generator resumed by the code that consumes it is not a call).
A pair of modules calling each other, in either order, is the back-and-forth; the test names every such pair,
the functions that made it, and the order the modules were first entered in.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from learner.config import LearnerSettings
from learner.service import LearnerService, ServiceConfig
from tests.runtime._inproc import InProc, scripted_app

ROOT = Path(__file__).resolve().parents[2]
LEARNER = str(ROOT / "learner") + "/"


def _module(filename: str) -> str | None:
    return filename[len(ROOT.as_posix()) + 1 : -3] if filename.startswith(LEARNER) and filename.endswith(".py") else None


@pytest.fixture
def srv(tiny_model_path: Path, tmp_path: Path) -> Iterator[InProc]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    replies = iter(["4", "5", "I think 4", "4", "6", "7", "8", "9", "10", "11", "12", "13"] * 4)
    app, _, store = scripted_app(tokenizer, lambda *_, **__: next(replies), tmp_path)
    s = InProc(app)
    s.store, s.data = store, tmp_path  # type: ignore[attr-defined]
    yield s
    s.close()


def _post(s: InProc, path: str, body: dict[str, Any]) -> Any:
    r = s.client.post(path, json=body, headers={"Authorization": "Bearer user-key"})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_update_calls_no_learner_module_back(srv: InProc, tiny_model_path: Path) -> None:
    for k, prompt in enumerate(("2 + 2?", "3 + 1?", "1 + 3?")):  # two-turn chats rated on the last reply
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        first = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4})
        messages += [first["choices"][0]["message"], {"role": "user", "content": "The number only."}]
        second = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4})
        _post(srv, "/v1/feedback", {"turn_id": second["loopwise"]["turn_id"], "reward": float(k % 2), "source": "thumbs"})
    group = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "5 + 5?"}], "n": 2, "max_tokens": 4})
    for i, choice in enumerate(group["choices"]):
        _post(srv, "/v1/feedback", {"completion_id": group["id"], "choice_index": choice["index"], "reward": float(i), "source": "thumbs"})
    settings = LearnerSettings.model_validate(
        {
            "family": "chat-lora",
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trainer": {"progress": False},
            "samples": {"settle_s": 0},
        }
    )
    cfg = ServiceConfig(data_dir=srv.data, admin_url="http://127.0.0.1:9", admin_key="k", base_model=tiny_model_path, settings=settings, gate_n=0)  # type: ignore[attr-defined]
    svc = LearnerService(cfg)
    calls: dict[tuple[str, str], str] = {}  # (caller module, callee module) -> the first such call, by function names
    order: list[str] = []

    def profile(frame: Any, event: str, _: Any) -> None:
        if event != "call" or frame.f_back is None or frame.f_code.co_flags & inspect.CO_GENERATOR:
            return  # a generator resumed by its consumer is data flowing along, not a call back
        callee = _module(frame.f_code.co_filename)
        caller = _module(frame.f_back.f_code.co_filename)
        if callee is None:
            return
        if callee not in order:
            order.append(callee)
        if caller is not None and caller != callee:
            calls.setdefault((caller, callee), f"{frame.f_back.f_code.co_qualname} -> {frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        record = svc.update(publish=False)
    finally:
        sys.setprofile(None)
    assert record["metrics"]["optimizer_step"] is True and record["metrics"]["trained_samples"] > 0
    assert "learner/trainer" in order and "learner/samples" in order  # the trace saw the path
    back_and_forth = sorted(f"{a} <-> {b} ({calls[a, b]}; {calls[b, a]})" for a, b in calls if (b, a) in calls and a < b)
    assert back_and_forth == [], f"learner modules calling each other: {back_and_forth}; first entered: {order}"
