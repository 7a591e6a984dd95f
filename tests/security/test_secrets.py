"""The server's secrets: keys from environment variables or key files (not only the command line, which every
local process can read in /proc), the data folder private (0700, files 0600), constant-time key checks."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest

import serve
from runtime.identity import KeyRing


def test_keys_from_key_files_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# one key per line\nk-file-1\n\n   k-file-2  \n")
    admin = tmp_path / "admin-key"
    admin.write_text("# the admin key\nadm-from-file\n")
    s = serve.settings_from_args(["--api-key", "k-flag", "--api-key-file", str(keys), "--admin-key-file", str(admin)]).server
    assert s.api_keys == ("k-flag", "k-file-1", "k-file-2") and s.admin_key == "adm-from-file"
    monkeypatch.setenv("LOOPWISE_API_KEY_FILE", str(keys))
    monkeypatch.setenv("LOOPWISE_ADMIN_KEY", "adm-from-env")
    s = serve.settings_from_args([]).server
    assert s.api_keys == ("k-file-1", "k-file-2") and s.admin_key == "adm-from-env"
    with pytest.raises(ValueError, match="not both"):
        serve.settings_from_args(["--admin-key-file", str(admin)])  # the env var gives one too
    monkeypatch.delenv("LOOPWISE_ADMIN_KEY")
    with pytest.raises(ValueError, match="cannot read key file"):
        serve.settings_from_args(["--admin-key-file", str(tmp_path / "missing")])


def test_key_checks_compare_digests_of_every_key() -> None:
    ring = KeyRing(["alpha", "beta"], "admin")
    assert ring.is_api_key("beta") and not ring.is_api_key("bet") and not ring.is_api_key("betaa") and not ring.is_api_key("")
    assert not ring.is_api_key("admin") and ring.is_admin_key("admin") and not ring.is_admin_key("beta")
    assert KeyRing([], None).open and not KeyRing([], None).is_admin_key("")


def test_the_data_folder_is_private_and_keys_stay_off_the_command_line(start_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    old = data / "memory.db"  # as an older version left it: world-readable (an empty file is an empty database)
    old.write_bytes(b"")
    old.chmod(0o644)
    server_key, admin_key = "k-env-only-7c1d", "adm-file-only-93ab"
    (tmp_path / "admin-key").write_text(admin_key + "\n")
    server = start_server(
        "--admin-key-file", str(tmp_path / "admin-key"), env={"LOOPWISE_API_KEYS": server_key}, data_dir=data
    )  # fmt: skip
    r = httpx.post(
        server.url + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {server_key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert httpx.get(server.base_url + "/admin/stats", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).status_code == 200
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert server_key.encode() not in cmdline and admin_key.encode() not in cmdline
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for f in data.iterdir():
        if f.name.startswith(("interactions.db", "memory.db")):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert (data / "interactions.db").exists() and stat.S_IMODE(old.stat().st_mode) == 0o600
