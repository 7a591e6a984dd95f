"""``bench/serving.py``'s harness without its servers: the dtype from ``/proc/cpuinfo``'s text, the thread passes, one
server at a time (started, measured, released before the next; missing software skipped, a failed start released and
reported), stopping a process group, and the table's figures and ratios against loopwise.

Not here: any timing, or a real server (``bench/serving.py --model tiny`` is the smoke run).
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Any

import pytest

from bench import serving
from bench.serving import Server, ServerSpec

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nbugs\t\t: spectre_v1\n"
VMX_ONLY = "flags\t\t: fpu avx2\nvmx flags\t: avx512_bf16\n"  # not the CPU's flags line


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [
        (AVX2_ONLY, "float32"),
        (VMX_ONLY, "float32"),
        ("flags\t\t: avx2 avx512f avx512_bf16\n", "bfloat16"),
        ("flags\t\t: avx2 amx_tile amx_bf16 amx_int8\n", "bfloat16"),
        ("", "float32"),
    ],
)
def test_auto_dtype_is_bf16_only_with_native_bf16(cpuinfo: str, dtype: str) -> None:
    assert serving.cpu_dtype(cpuinfo) == dtype


def test_thread_passes() -> None:
    assert serving.thread_counts("default", 8) == [8]
    assert serving.thread_counts("1", 8) == [1]
    assert serving.thread_counts("both", 8) == [8, 1]
    assert serving.thread_counts("both", 1) == [1]
    assert serving.threads_arg("3") == "3"
    for bad in ("0", "two", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            serving.threads_arg(bad)


def test_servers_run_one_at_a_time_and_every_pass_repeats_the_table() -> None:
    events: list[tuple[str, ...]] = []

    def starter(name: str, fail: bool = False) -> Callable[[int], Server]:
        def start(threads: int) -> Server:
            events.append(("start", name, str(threads)))
            if fail:
                raise RuntimeError("did not become healthy")
            return Server(name, f"http://127.0.0.1:1/{name}", "m", ignore_eos=True)

        return start

    def measure(server: Server, spec: ServerSpec, threads: int) -> dict[str, Any]:
        events.append(("measure", server.name, str(threads)))
        return {"clients": {"1": {"tok_s": [10.0 * threads], "load": [0.1]}}}

    def release(server: Server | None, mem_before: dict[str, int]) -> None:
        events.append(("release", server.name if server else "-"))

    specs = [
        ServerSpec("loopwise", starter("loopwise"), in_process=True),
        ServerSpec("vllm", starter("vllm"), missing="vLLM's CPU build is not installed"),
        ServerSpec("broken", starter("broken", fail=True)),
        ServerSpec("transformers", starter("transformers")),
    ]
    runs = serving.run_all(specs, [2, 1], measure, release)

    one_pass = [
        ("start", "loopwise"),
        ("measure", "loopwise"),
        ("release", "loopwise"),
        ("start", "broken"),
        ("release", "-"),  # what a failed start left running is stopped too
        ("start", "transformers"),
        ("measure", "transformers"),
        ("release", "transformers"),
    ]
    expected = [(*e, t) if e[0] != "release" else e for t in ("2", "1") for e in one_pass]
    assert events == expected
    assert [r["threads"] for r in runs] == [2, 1]
    for run in runs:
        assert list(run["servers"]) == ["loopwise", "transformers"]
        assert run["skipped"] == {"vllm": "vLLM's CPU build is not installed"}
        assert run["failed"] == {"broken": "RuntimeError: did not become healthy"}
        assert all(len(s["load_before"]) == 3 for s in run["servers"].values())


def test_blocks_alternate_the_servers_and_pool_each_ones_rounds() -> None:
    order: list[str] = []
    tok = {"loopwise": iter([100.0, 90.0, 300.0, 310.0]), "vllm": iter([80.0, 70.0, 400.0, 390.0])}  # a drift between blocks
    ttft = {"loopwise": iter([1.0, 3.0]), "vllm": iter([2.0, 6.0])}

    def start(name: str) -> Callable[[int], Server]:
        return lambda threads: Server(name, f"http://127.0.0.1:1/{name}", "m", ignore_eos=True)

    def measure(server: Server, spec: ServerSpec, threads: int) -> dict[str, Any]:
        order.append(server.name)
        t = [next(tok[server.name]), next(tok[server.name])]
        lp = {"idle_ttft_s": next(ttft[server.name]), "ttft_s": 5.0, "max_decode_gap_s": None, "load": 1.0}
        return {"clients": {"16": {"tok_s": t, "load": [1.0, 1.0]}}, "long_prompt": lp, "adapters": {"single": [t[0]], "mixed": [t[1]]}}

    specs = [ServerSpec("loopwise", start("loopwise")), ServerSpec("vllm", start("vllm"))]
    (run,) = serving.run_all(specs, [2], measure, lambda server, mem: None, blocks=2)
    assert order == ["loopwise", "vllm", "loopwise", "vllm"]
    lw, v = run["servers"]["loopwise"], run["servers"]["vllm"]
    assert lw["clients"]["16"]["tok_s"] == [100.0, 90.0, 300.0, 310.0] and len(lw["clients"]["16"]["load"]) == 4
    assert v["adapters"] == {"single": [80.0, 400.0], "mixed": [70.0, 390.0]}
    assert lw["long_prompt"]["idle_ttft_s"] == 2.0 and v["long_prompt"]["idle_ttft_s"] == 4.0  # medians over the blocks
    assert lw["long_prompt"]["max_decode_gap_s"] is None and len(v["long_prompt_blocks"]) == 2
    rows = dict((label, values) for label, values, _ in serving.table_rows(run, [16], 2000))
    assert rows["tok/s, 16 clients"] == [200.0, 235.0]  # each server's median over both blocks' rounds
    assert run["blocks"] == 2


def test_a_server_failing_in_a_later_block_is_reported_failed_not_half_measured() -> None:
    calls = {"vllm": 0}

    def start(name: str) -> Callable[[int], Server]:
        def go(threads: int) -> Server:
            if name == "vllm":
                calls["vllm"] += 1
                if calls["vllm"] == 2:
                    raise RuntimeError("did not become healthy")
            return Server(name, f"http://127.0.0.1:1/{name}", "m", ignore_eos=True)

        return go

    def measure(server: Server, spec: ServerSpec, threads: int) -> dict[str, Any]:
        return {"clients": {"1": {"tok_s": [1.0], "load": [0.1]}}}

    specs = [ServerSpec("loopwise", start("loopwise")), ServerSpec("vllm", start("vllm"))]
    (run,) = serving.run_all(specs, [2], measure, lambda server, mem: None, blocks=3)
    assert list(run["servers"]) == ["loopwise"] and run["failed"] == {"vllm": "RuntimeError: did not become healthy"}
    assert calls["vllm"] == 2  # not started again once it failed
    assert run["servers"]["loopwise"]["clients"]["1"]["tok_s"] == [1.0, 1.0, 1.0]


def fake_run() -> dict[str, Any]:
    loopwise = {
        "load_before": [0.5, 0.4, 0.3],
        "clients": {"1": {"tok_s": [50.0, 52.0, 60.0], "load": [0.5] * 3}, "16": {"tok_s": [260.0], "load": [1.0]}},
        "long_prompt": {"idle_ttft_s": 2.0, "ttft_s": 3.0, "max_decode_gap_s": 1.0},
        "adapters": {"single": [200.0, 200.0], "mixed": [180.0, 180.0]},
    }
    peer = {
        "load_before": [1.5, 1.0, 0.8],
        "clients": {"1": {"tok_s": [25.0, 26.0, 27.0], "load": [1.5] * 3}, "16": {"tok_s": [200.0], "load": [1.4]}},
        "long_prompt": {"idle_ttft_s": 4.0, "ttft_s": 6.0, "max_decode_gap_s": None},
    }
    return {"threads": 2, "servers": {"loopwise": loopwise, "transformers": peer}, "skipped": {"vllm": "not installed"}, "failed": {}}


def test_the_table_takes_medians_and_ratios_favour_loopwise_above_one() -> None:
    rows = {label: (values, better) for label, values, better in serving.table_rows(fake_run(), [1, 16], 1990)}
    assert rows["load average before (1 min)"] == ([0.5, 1.5], None)
    assert rows["tok/s, 1 client"] == ([52.0, 26.0], "higher")  # medians of the rounds
    assert rows["tok/s, 16 clients"] == ([260.0, 200.0], "higher")
    assert rows["TTFT 1990-token prompt, idle (s)"] == ([2.0, 4.0], "lower")
    assert rows["  their longest token gap (s)"] == ([1.0, None], "lower")
    assert rows["  mixed ÷ single"] == ([0.9, None], None)  # loopwise only: the peer took no adapters

    names = ["loopwise", "transformers"]
    assert serving.vs_loopwise(names, [52.0, 26.0], "higher") == [2.0]  # loopwise ÷ it
    assert serving.vs_loopwise(names, [2.0, 4.0], "lower") == [2.0]  # it ÷ loopwise
    assert serving.vs_loopwise(names, [1.0, None], "lower") == [None]
    assert serving.vs_loopwise(names, [0.9, None], None) == [None]
    assert serving.vs_loopwise(["transformers"], [26.0], "higher") == [None]  # no loopwise figure to compare with

    text = serving.format_run(fake_run(), [1, 16], 1990, cpus=2)
    assert "2 thread(s) per server (every usable CPU: the default)" in text
    assert "loopwise vs transformers" in text
    assert "vllm: skipped, not installed" in text
    line = next(x for x in text.splitlines() if x.startswith("tok/s, 1 client"))
    assert line.split()[-3:] == ["52.0", "26.0", "2.00"]


def test_release_stops_the_whole_process_group_and_waits_for_the_port() -> None:
    proc = serving.spawn(["sh", "-c", "sleep 60 & sleep 60"])  # a server and a worker it started
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not serving.port_free(port)
    assert serving.port_free(port)
    serving.release(Server("x", f"http://127.0.0.1:{port}", "m", ignore_eos=True), serving.meminfo_mb())
    assert serving.STARTED == []
    assert proc.poll() is not None
    assert serving.group_members(proc.pid) == []
