"""The suite's file order (tests/_file_order.py): longest recorded file first, each file's tests together and in order."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import _file_order


@dataclass
class _Item:
    nodeid: str


@given(
    files=st.lists(st.sampled_from([f"tests/t{i}.py" for i in range(8)]), min_size=1, max_size=40),
    seconds=st.dictionaries(st.sampled_from([f"tests/t{i}.py" for i in range(8)]), st.floats(0, 100)),
)
def test_files_go_longest_first_and_stay_whole(tmp_path_factory, files, seconds):
    record = tmp_path_factory.mktemp("order") / "file_durations.json"
    record.write_text(json.dumps(seconds))
    items = [_Item(f"{f}::test_{n}") for n, f in enumerate(files)]
    original = list(items)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_file_order, "RECORD", record)
        _file_order.order_by_recorded_seconds(items)  # type: ignore[arg-type]
    assert sorted(i.nodeid for i in items) == sorted(i.nodeid for i in original)  # nothing added or lost
    order = [i.nodeid.split("::")[0] for i in items]
    runs = [f for k, f in enumerate(order) if k == 0 or order[k - 1] != f]
    assert len(runs) == len(set(order))  # each file's tests are together
    for f in set(order):  # and in their collected order
        assert [i.nodeid for i in items if i.nodeid.startswith(f + "::")] == [i.nodeid for i in original if i.nodeid.startswith(f + "::")]
    known = [seconds[f] for f in runs if f in seconds]
    assert known == sorted(known, reverse=True)  # recorded files, longest first
    if seconds:  # a file without a record goes where the median file would
        middle = statistics.median(seconds.values())
        cost = [seconds.get(f, middle) for f in runs]
        assert cost == sorted(cost, reverse=True)


def test_a_missing_or_broken_record_keeps_the_collected_order(tmp_path, monkeypatch):
    for text in (None, "not json", "[1, 2]"):
        record = tmp_path / "file_durations.json"
        if text is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(text)
        monkeypatch.setattr(_file_order, "RECORD", record)
        items = [_Item("tests/b.py::x"), _Item("tests/a.py::y"), _Item("tests/b.py::z")]
        _file_order.order_by_recorded_seconds(items)  # type: ignore[arg-type]
        assert [i.nodeid for i in items] == ["tests/b.py::x", "tests/b.py::z", "tests/a.py::y"]
