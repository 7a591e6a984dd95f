"""The embedded engine bounds oneDNN's per-shape caches (runtime/engines/embedded.py, ``bound_onednn_caches``).

oneDNN's primitive cache and ideep's linear cache keep one entry per distinct input shape, and every engine step has
its own token count, so under varied traffic the server's memory grew step after step (the soak's RSS climb). Each
case runs in a fresh process, because both caches read their capacity once per process: the engine serves prompts
of 120 different lengths (one prefill step each, so 120 token counts through every linear), and glibc's in-use bytes
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
        await run(range(9, 129))
        print(json.dumps({"growth_mb": in_use_mb() - before, "cap": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}))
    finally:
        await engine.close()

asyncio.run(main())
"""


def _growth(model: Path, default_caches: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["HF_HUB_OFFLINE"] = "1"
    if default_caches:
        env["LOOPWISE_TEST_DEFAULT_CACHES"] = "1"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CHILD, str(model)], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_distinct_token_counts_do_not_grow_the_engines_memory(tiny_model_path: Path) -> None:
    bounded = _growth(tiny_model_path, default_caches=False)
    unbounded = _growth(tiny_model_path, default_caches=True)
    assert bounded["cap"] == "64"
    # measured on the tiny model: +8.6 MB bounded, +265 MB with the libraries' defaults (120 token counts)
    assert float(unbounded["growth_mb"]) > max(100.0, 3 * float(bounded["growth_mb"])), (bounded, unbounded)  # the control grows
    assert float(bounded["growth_mb"]) < 40.0, bounded
