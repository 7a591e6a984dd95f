"""The publish contract (``learner/records/adapter_manifest.py``): one manifest model and one file hash for writer and reader."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from learner.records.adapter_manifest import MANIFEST_FILE, AdapterManifest, ManifestError, manifest_sha256, sha256_file

ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2, appendix B.1


def test_sha256_file_is_the_standard_digest_also_past_one_chunk(tmp_path: Path) -> None:
    (tmp_path / "abc").write_bytes(b"abc")
    assert sha256_file(tmp_path / "abc") == ABC_SHA256
    # FIPS 180-2 appendix B.3: one million "a"
    (tmp_path / "a").write_bytes(b"a" * 1_000_000)
    assert sha256_file(tmp_path / "a") == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
    # read in 1 MiB chunks: a file past several chunk boundaries hashes as one buffer does
    data = os.urandom(3 * (1 << 20) + 7)
    (tmp_path / "big").write_bytes(data)
    assert sha256_file(tmp_path / "big") == hashlib.sha256(data).hexdigest()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / MANIFEST_FILE).write_bytes(b"abc")
    assert manifest_sha256(tmp_path / "m") == ABC_SHA256


def test_both_file_forms_read_as_one_mapping_and_extra_keys_are_kept(tmp_path: Path) -> None:
    (tmp_path / "w").write_bytes(b"abc")
    upper = ABC_SHA256.upper()
    as_map = tmp_path / "a.json"
    as_map.write_text(json.dumps({"files": {"w": upper}, "metrics": {"loss": 0.5}}))
    as_list = tmp_path / "b.json"
    as_list.write_text(json.dumps({"files": [{"path": "w", "sha256": upper}]}))
    a, b = AdapterManifest.read(as_map), AdapterManifest.read(as_list)
    assert a.files == b.files == {"w": ABC_SHA256}  # digests compare lower-case
    assert a.mismatched(tmp_path) == []
    assert json.loads(a.dump())["metrics"] == {"loss": 0.5} and a.format == 1 and a.family is None
    (tmp_path / "w").write_bytes(b"abd")
    assert a.mismatched(tmp_path) == ["w"]
    (tmp_path / "w").unlink()
    assert a.mismatched(tmp_path) == ["w"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (None, "missing or not JSON"),
        ("{not json", "missing or not JSON"),
        ("[1, 2]", "not an object"),
        ("{}", "malformed"),
        ('{"files": [{"path": "w"}]}', "malformed"),
        ('{"files": {"w": 3}}', "malformed"),
    ],
)
def test_a_bad_manifest_says_what_is_wrong(tmp_path: Path, text: str | None, why: str) -> None:
    path = tmp_path / MANIFEST_FILE
    if text is not None:
        path.write_text(text)
    with pytest.raises(ManifestError, match=why):
        AdapterManifest.read(path)
