"""Which real engine servers a test run starts: ``LOOPWISE_TEST_ENGINES``.

``make test-engines`` sets it to its ``ENGINES`` (default ``vllm sglang``; ``.ci/run`` names the ones installed
on the machine); ``1`` means every engine. Unset or empty: the default suite, which starts no real engine
server. ``asked(name)`` says whether that engine's real servers run in this session.

Not here: the servers themselves (``_vllm.py``, ``_sglang.py``).
"""

from __future__ import annotations

import os

_ASKED = os.environ.get("LOOPWISE_TEST_ENGINES", "").replace(",", " ").split()
ENGINES = bool(_ASKED) and _ASKED != ["0"]
ASKED_TEXT = " ".join(_ASKED)


def asked(engine: str) -> bool:
    return ENGINES and ("1" in _ASKED or engine in _ASKED)
