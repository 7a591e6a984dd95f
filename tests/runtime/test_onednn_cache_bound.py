"""The embedded engine bounds oneDNN's per-shape caches (runtime/engines/embedded.py, ``bound_onednn_caches``).

oneDNN's primitive cache and ideep's linear cache keep one entry per distinct input shape, and every engine step has
its own token count, so under varied traffic the server's memory grew step after step (the soak's RSS climb). Each
case runs in a fresh process, because both caches read their capacity once per process: the engine serves prompts
of 80 different lengths (one prefill step each, so 80 token counts through every linear), and glibc's in-use bytes
(``mallinfo2``) must not grow with them. ``LOOPWISE_TEST_DEFAULT_CACHES`` puts the library defaults back, the
before-the-fix control, which must grow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHILD = r"""
import asyncio, ctypes, json, os, sys
from pathlib import Path
from typing import Any
if os.environ.get("LOOPWISE_TEST_DEFAULT_CACHES"):
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ["LRU_CACHE_CAPACITY"] = "1024"  # the libraries' defaults
from runtime.engine import GenerateRequest, SamplingParams
from runtime.engines.embedded import EmbeddedEngine

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                                               "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def in_use_mb():
    return libc.mallinfo2().uordblks / 2**20

async def main():
    engine = EmbeddedEngine(Path(sys.argv[1]), model_id="tiny", dtype="float32", max_model_len=512)
    await engine.start()
    try:
        async def run(lengths):
            for n in lengths:
                ids = tuple(5 + (i % 50) for i in range(n))
                await engine.generate(GenerateRequest(f"r{n}", ids, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)))
        await run(range(1, 9))  # warm-up
        before = in_use_mb()
        await run(range(9, 89))
        print(json.dumps({"growth_mb": in_use_mb() - before, "cap": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}))
    finally:
        await engine.close()

asyncio.run(main())
"""


def _start(model: Path, default_caches: bool) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["HF_HUB_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # the two children run side by side
    if default_caches:
        env["LOOPWISE_TEST_DEFAULT_CACHES"] = "1"
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-c", CHILD, str(model)], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _growth(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_distinct_token_counts_do_not_grow_the_engines_memory(tiny_model_path: Path) -> None:
    procs = _start(tiny_model_path, default_caches=False), _start(tiny_model_path, default_caches=True)
    bounded, unbounded = (_growth(p) for p in procs)
    assert bounded["cap"] == "64"
    # measured on the tiny model with 120 token counts: +8.6 MB bounded, +265 MB with the libraries' defaults
    assert float(unbounded["growth_mb"]) > max(80.0, 3 * float(bounded["growth_mb"])), (bounded, unbounded)  # the control grows
    assert float(bounded["growth_mb"]) < 40.0, bounded
