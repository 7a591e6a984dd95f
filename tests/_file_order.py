"""The order test files reach the pytest-xdist workers: longest first, so no worker runs a long file alone at the end.

``make test`` hands whole files to workers (``--dist loadfile``), in collection order (``--no-loadscope-reorder``;
xdist's own reorder puts files with many tests first, whatever their length). This plugin sorts the collection by
each file's recorded seconds (``tests/file_durations.json``), longest first: the classic longest-processing-time
rule, which keeps the last worker to finish from starting a 40-second file when the others are nearly done. A file
without a record counts as the median one. Tests inside a file keep their order; what runs is unchanged.

``pytest --record-file-durations`` (with or without ``-n``) rewrites the record from the run: each file's setup, call
and teardown seconds, summed. Re-record after adding a heavy file; a stale record costs time, never a result.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("file_durations.json")
_seconds: defaultdict[str, float] = defaultdict(float)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _recorded() -> dict[str, float]:
    try:
        data = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--record-file-durations", action="store_true", help=f"rewrite {RECORD.name} from this run's per-file seconds")


def order_by_recorded_seconds(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place: files by recorded seconds, longest first; within a file, the collected order."""
    recorded = _recorded()
    default = statistics.median(recorded.values()) if recorded else 0.0
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_file_of(item.nodeid), i)

    def key(item: pytest.Item) -> tuple[float, int]:
        f = _file_of(item.nodeid)
        return (-recorded.get(f, default), first[f])

    items.sort(key=key)  # stable: a file's tests keep their collected order


def note_report(report: pytest.TestReport) -> None:
    _seconds[_file_of(report.nodeid)] += report.duration


def write_record(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--record-file-durations") or hasattr(config, "workerinput"):  # the controller writes, once
        return
    if not _seconds:
        return
    RECORD.write_text(json.dumps({f: round(s, 1) for f, s in sorted(_seconds.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")
