"""One start of a serving process on a model cache, as ``tests/runtime/test_first_start.py`` makes it (a helper module).

``start(cache, spec, folder)`` runs a fresh interpreter that resolves ``spec`` in ``cache`` (building the model
there when it is missing, as ``make serve`` does on its first start), serves one request from the embedded
engine and reports whether it built, whether torch was imported by the build, and the threads it holds that Python
did not start (an OpenMP pool's are among them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_SERVE = """
import asyncio, json, os, sys, threading
from pathlib import Path
from runtime.model_store import MARKER, resolve_model

cache, spec, folder = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
built = not (cache / folder / MARKER).exists()
path = resolve_model(spec, cache)
torch_after_resolve = "torch" in sys.modules

from runtime.engine import GenerateRequest, SamplingParams
from runtime.engines.embedded import EmbeddedEngine


async def main():
    engine = EmbeddedEngine(path, model_id="m", threads=2)  # 2: a pool even on one CPU
    await engine.start()
    await engine.generate(GenerateRequest("r", (5, 6, 7), SamplingParams(max_new_tokens=4, temperature=0)))
    # the threads Python did not start (OpenMP's pool, torch's own): Python 3.11 names none of its threads, so the
    # default executor's workers, whose number depends on timing under load, would read as "python" too
    ours = {t.native_id for t in threading.enumerate()}
    threads = sorted(
        open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task") if int(t) not in ours
    )
    await engine.close()
    return threads


threads = asyncio.run(main())
print(json.dumps({"built": built, "torch_after_resolve": torch_after_resolve, "threads": threads}))
"""


def start(cache: Path, spec: str, folder: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO_ROOT))
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-c", _SERVE, str(cache), spec, folder]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
