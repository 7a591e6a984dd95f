"""Traffic over time from the counters (``runtime/traffic.py``): quantiles from histogram buckets as
Prometheus computes them, rates per interval from hand-set counters, and ``GET /admin/traffic`` on a
real app (a scripted engine at the engine edge only) where ids in paths do not become metric labels."""

from __future__ import annotations

import math
import time

import pytest

from runtime.metrics import Metrics
from runtime.traffic import TrafficHistory, histogram_quantile


def test_histogram_quantile_interpolates_inside_the_bucket():
    # 10 observations: 2 <= 0.1 s, 4 in (0.1, 0.5], 4 in (0.5, 1]
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / (6 - 2))  # rank 5 in (0.1, 0.5]: 0.4
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (9.5 - 6) / (10 - 6))  # rank 9.5: 0.9375
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.1 * 1 / 2)  # the first bucket starts at 0
    assert histogram_quantile(0.5, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_rates_per_interval_and_totals():
    m = Metrics(lambda: {})
    th = TrafficHistory(m, interval_s=10, window_s=60)
    m.adapter_requests.labels("base").inc(5)  # before the window: not counted
    th.sample(now=1000.0)
    m.adapter_requests.labels("base").inc(30)
    m.adapter_requests.labels("calc@1").inc(10)
    m.adapter_tokens.labels("base").inc(300)
    m.adapter_tokens.labels("calc@1").inc(100)
    for _ in range(30):
        m.adapter_latency.labels("base").observe(0.2)  # bucket (0.1, 0.25]
    for _ in range(10):
        m.adapter_latency.labels("calc@1").observe(3.0)  # bucket (2.5, 5]
    m.requests.labels("/v1/chat/completions", "200").inc(40)
    m.requests.labels("/v1/chat/completions", "429").inc(3)
    m.adapter_errors.labels("calc@1", "503").inc(2)
    m.adapter_errors.labels("calc@1", "499").inc(1)
    m.adapter_errors.labels("gone@3", "500").inc(1)  # an adapter that only failed is still listed
    m.requests.labels("/admin/learner", "401").inc(2)
    th.sample(now=1010.0)
    out = th.series(minutes=1, now=1010.5)  # under a second since the last snapshot: no partial point
    (p,) = out["points"]
    assert p["dt"] == 10 and p["requests_per_s"] == 4.0 and p["tokens_per_s"] == 40.0
    assert p["errors"] == {"429": 3.0, "401": 2.0}
    assert p["by_adapter"]["base"]["requests_per_s"] == 3.0 and p["by_adapter"]["calc@1"]["tokens_per_s"] == 10.0
    assert p["by_adapter"]["base"]["latency_p50_s"] == pytest.approx(0.1 + 0.15 * 15 / 30)  # all 30 in (0.1, 0.25]
    assert p["by_adapter"]["calc@1"]["latency_p95_s"] == pytest.approx(2.5 + 2.5 * 9.5 / 10)
    assert p["by_adapter"]["calc@1"]["errors"] == {"503": 2.0, "499": 1.0} and p["by_adapter"]["base"]["errors"] == {}
    assert p["by_adapter"]["gone@3"]["requests_per_s"] == 0.0 and p["by_adapter"]["gone@3"]["errors"] == {"500": 1.0}
    # all 40: 30 in (0.1, 0.25], 10 in (2.5, 5]; rank 20 -> 0.1 + 0.15 * 20/30; rank 38 -> 2.5 + 2.5 * 8/10
    assert p["latency_p50_s"] == pytest.approx(0.2) and p["latency_p95_s"] == pytest.approx(4.5)
    t = out["totals"]
    assert t["requests"] == 40 and t["tokens"] == 400 and t["errors"] == {"429": 3.0, "401": 2.0}
    assert t["by_adapter"]["base"]["share"] == 0.75 and t["by_adapter"]["calc@1"]["share"] == 0.25
    assert t["by_adapter"]["calc@1"]["errors"] == {"503": 2.0, "499": 1.0} and t["by_adapter"]["gone@3"]["share"] == 0.0
    assert t["errors_by_endpoint"] == {"/v1/chat/completions": {"429": 3.0}, "/admin/learner": {"401": 2.0}}
    # an idle interval, then the one in progress (partial)
    th.sample(now=1020.0)
    m.adapter_requests.labels("base").inc(6)
    out = th.series(minutes=1, now=1023.0)
    assert [round(q["requests_per_s"], 6) for q in out["points"]] == [4.0, 0.0, 2.0]
    assert out["points"][-1]["partial"] is True and out["points"][-1]["dt"] == 3.0
    assert out["points"][1]["latency_p50_s"] is None and out["points"][1]["by_adapter"] == {}


def test_window_is_bounded():
    m = Metrics(lambda: {})
    th = TrafficHistory(m, interval_s=10, window_s=60)
    for i in range(100):
        th.sample(now=float(i * 10))
    assert len(th.snapshots) == 7
    assert len(th.series(minutes=1, now=990.0)["points"]) == 6


@pytest.fixture
def app_client(tiny_model_path, tmp_path):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from learner.records.store import SqliteStore
    from runtime.app import create_app
    from runtime.engine import EngineOverloaded
    from runtime.recorder import Recorder
    from runtime.settings import EngineSettings, ServerSettings
    from tests.agents._scripted import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_path)

    class Engine(ScriptedEngine):
        tokenizer = tok

    def script(req):
        if "fail" in tok.decode(list(req.input_ids)):
            raise EngineOverloaded("queue full", retry_after=1.0)
        return "four"

    engine = Engine(tok, script)
    recorder = Recorder(SqliteStore(tmp_path / "interactions.db"), durability="sync")
    app = create_app(ServerSettings(admin_key="adm", data_dir=tmp_path), EngineSettings(), engine, "tiny", recorder=recorder)
    with TestClient(app) as tc:
        yield tc


def test_admin_traffic_counts_model_requests_and_keeps_path_ids_out_of_labels(app_client):
    tc = app_client
    admin = {"authorization": "Bearer adm"}
    tokens = 0
    for _ in range(3):
        r = tc.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["completion_tokens"]
    for i in range(5):
        assert tc.get(f"/admin/trajectories/traj-{i}", headers=admin).status_code == 404
    assert tc.get("/v1/models/no/such:model").status_code == 404
    assert tc.get("/admin/traffic", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert tc.get("/admin/traffic?minutes=0", headers=admin).status_code == 400
    traffic = tc.app.state.services.traffic
    traffic.snapshots[-1] = type(traffic.snapshots[-1])(time.time() - 5, {})  # the window started before the requests
    out = tc.get("/admin/traffic", headers=admin).json()
    assert out["totals"]["requests"] == 3 and out["totals"]["by_adapter"]["base"]["requests"] == 3
    assert tokens > 0 and out["totals"]["tokens"] == tokens
    assert out["points"][-1]["partial"] and out["points"][-1]["requests_per_s"] > 0
    assert out["totals"]["errors_by_endpoint"]["/admin/trajectories/{trajectory_id}"] == {"404": 5.0}
    assert out["totals"]["errors_by_endpoint"]["/admin/traffic"] == {"401": 1.0, "400": 1.0}
    metrics = tc.get("/metrics").text
    assert "traj-3" not in metrics and 'endpoint="/admin/trajectories/{trajectory_id}"' in metrics
    assert 'endpoint="/v1/models/{model}",status="404"' in metrics and "such" not in metrics  # the converter is not part of the label


def test_agent_model_calls_count_per_adapter(tiny_model_path, tmp_path):
    """Agent runs reach the engine through LocalRuntimeClient, not the chat route: their calls count too (the demo's traffic)."""
    import asyncio

    from transformers import AutoTokenizer

    from runtime.adapters.registry import AdapterRegistry
    from runtime.agent_api import LocalRuntimeClient
    from runtime.chat_format import ChatFormatter
    from runtime.engine import SamplingParams
    from tests.agents._scripted import ScriptedEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = ScriptedEngine(tok, lambda req: "one two three")
    m = Metrics(lambda: {})
    registry = AdapterRegistry(max_loaded=2, load_fn=lambda ref: engine.load_adapter(ref.name, ref.path), unload_fn=engine.unload_adapter)
    client = LocalRuntimeClient(engine, ChatFormatter(tok), registry, None, "tiny", metrics=m)  # type: ignore[arg-type]

    async def main() -> tuple[int, int]:
        res = await client.generate([1, 2], SamplingParams(max_new_tokens=8), None, "r1")
        n = 0
        stream = client.stream([1, 2], SamplingParams(max_new_tokens=8), "calc@1", "r2")
        async for chunk in stream:
            n += len(chunk.token_ids)
            break  # the caller stops early: still one request, with the tokens it got
        await stream.aclose()
        return len(res.output_ids), n

    full, partial = asyncio.run(main())
    assert m.adapter_requests.labels("base")._value.get() == 1 and m.adapter_tokens.labels("base")._value.get() == full
    assert m.adapter_requests.labels("calc@1")._value.get() == 1 and m.adapter_tokens.labels("calc@1")._value.get() == partial == 1
    assert engine.closed_streams == 1  # closing the wrapper closed the engine's stream


def test_admin_learner_history_length_and_a_line_being_written(app_client, tmp_path):
    import json

    d = tmp_path / "learner" / "fam"
    d.mkdir(parents=True)
    (d / "status.json").write_text(json.dumps({"family": "fam", "state": "idle", "version": 30, "updated_at": time.time()}))
    lines = [json.dumps({"version": v, "metrics": {"reward_mean": v / 100}}) for v in range(1, 31)]
    (d / "history.jsonl").write_text("\n".join(lines) + '\n{"version": 31, "metr')  # the learner is appending right now
    admin = {"authorization": "Bearer adm"}
    default = app_client.get("/admin/learner", headers=admin).json()["data"][0]["history"]
    assert [h["version"] for h in default] == list(range(11, 31))  # the last 20 whole lines
    assert [h["version"] for h in app_client.get("/admin/learner?history=100", headers=admin).json()["data"][0]["history"]] == list(range(1, 31))
    assert "history" not in app_client.get("/admin/learner?history=0", headers=admin).json()["data"][0]
    assert app_client.get("/admin/learner?history=5000", headers=admin).status_code == 400


def test_admin_traffic_counts_failed_model_requests_per_adapter(app_client):
    tc = app_client
    admin = {"authorization": "Bearer adm"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "please fail"}], "max_tokens": 4}
    assert tc.post("/v1/chat/completions", json=body).status_code == 429
    assert tc.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 429
    assert tc.post("/v1/chat/completions", json={**body, "model": "no-such-model"}).status_code == 404  # not an adapter's error
    traffic = tc.app.state.services.traffic
    traffic.snapshots[-1] = type(traffic.snapshots[-1])(time.time() - 5, {})
    out = tc.get("/admin/traffic", headers=admin).json()
    assert out["totals"]["by_adapter"]["base"]["errors"] == {"429": 2.0}
    assert set(out["totals"]["by_adapter"]) == {"base"}
    assert 'loopwise_adapter_errors_total{adapter="base",status="429"} 2.0' in tc.get("/metrics").text
