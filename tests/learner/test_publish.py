"""Publishing adapters: a completed publish passes the runtime's validate_adapter; failures and a real
SIGKILL mid-publish leave no final folder and only staging leftovers that the next start removes; a
corrupted staged or published file is refused; versions are immutable. The admin client's retry rules
run against httpx.MockTransport (the runtime is the external edge here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import learner.publish as pub
from learner.publish import (
    AdminError,
    AdminUnavailable,
    PublishError,
    RuntimeAdmin,
    adapter_path,
    clean_staging,
    publish_adapter,
    publish_files,
    verify_manifest,
)
from runtime.adapters.names import AdapterInvalid
from runtime.adapters.validation import validate_adapter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peft_model(tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    shapes = {n: (int(m.out_features), int(m.in_features)) for n, m in base.named_modules() if n and hasattr(m, "in_features")}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model, shapes


@pytest.fixture(scope="module")
def adapter_files(peft_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved adapter folder to copy from (a writer that needs no torch, for the subprocess)."""
    src = tmp_path_factory.mktemp("src")
    peft_model[0].save_pretrained(str(src), safe_serialization=True)
    return src


def copy_writer(src: Path):
    def write(dest: Path) -> None:
        for f in sorted(src.iterdir()):
            (dest / f.name).write_bytes(f.read_bytes())

    return write


def staging_entries(root: Path) -> list[Path]:
    staging = root / ".staging"
    return sorted(staging.iterdir()) if staging.is_dir() else []


def test_completed_publish_is_valid_and_pinned_by_its_manifest_hash(peft_model, tmp_path: Path) -> None:
    model, shapes = peft_model
    published = publish_adapter(model, tmp_path, "fam", 1, meta={"metrics": {"loss": 0.5}})
    assert published.path == adapter_path(tmp_path, "fam", 1) == tmp_path / "fam" / "v1"
    assert published.name == "fam@1"
    config = validate_adapter(published.path, base_shapes=shapes, max_rank=8, adapter_root=tmp_path, expected_sha256=published.manifest_sha256)
    assert config["peft_type"] == "LORA" and config["r"] == 4
    manifest = json.loads((published.path / "manifest.json").read_text())
    assert manifest["family"] == "fam" and manifest["version"] == 1 and manifest["metrics"] == {"loss": 0.5}
    on_disk = {p.name for p in published.path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk >= {"adapter_config.json", "adapter_model.safetensors"}
    assert verify_manifest(published.path) == published.files
    assert staging_entries(tmp_path) == []
    with pytest.raises(AdapterInvalid, match="manifest.json does not match"):  # another manifest hash pins other files
        validate_adapter(published.path, base_shapes=shapes, max_rank=8, adapter_root=tmp_path, expected_sha256="0" * 64)


def test_versions_are_immutable(adapter_files: Path, tmp_path: Path) -> None:
    first = publish_files(copy_writer(adapter_files), tmp_path, "fam", 2)
    before = (first.path / "manifest.json").read_bytes()
    with pytest.raises(PublishError, match="immutable"):
        publish_files(copy_writer(adapter_files), tmp_path, "fam", 2)
    assert (first.path / "manifest.json").read_bytes() == before
    with pytest.raises(PublishError, match="start at 1"):
        publish_files(copy_writer(adapter_files), tmp_path, "fam", 0)


def test_failure_after_some_files_leaves_nothing(adapter_files: Path, tmp_path: Path) -> None:
    def half_writer(dest: Path) -> None:
        (dest / "adapter_config.json").write_bytes((adapter_files / "adapter_config.json").read_bytes())
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        publish_files(half_writer, tmp_path, "fam", 1)
    assert not adapter_path(tmp_path, "fam", 1).exists() and staging_entries(tmp_path) == []
    with pytest.raises(PublishError, match="did not produce"):  # a writer that forgets the weights
        publish_files(lambda d: (d / "adapter_config.json").write_text("{}"), tmp_path, "fam", 1)
    assert not adapter_path(tmp_path, "fam", 1).exists() and staging_entries(tmp_path) == []


def test_failure_at_the_rename_leaves_nothing(adapter_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_rename(src: object, dst: object) -> None:
        raise OSError("EXDEV (simulated)")

    monkeypatch.setattr(pub.os, "rename", failing_rename)
    with pytest.raises(PublishError, match="could not move"):
        publish_files(copy_writer(adapter_files), tmp_path, "fam", 1)
    assert not adapter_path(tmp_path, "fam", 1).exists() and staging_entries(tmp_path) == []


def test_a_byte_flipped_while_staged_is_never_renamed(adapter_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = pub.fsync_path

    def fsync_then_corrupt(path: Path) -> None:
        real_fsync(path)
        if path.is_dir() and path.parent.name == ".staging":  # the staging folder, after the manifest was written
            weights = path / "adapter_model.safetensors"
            raw = bytearray(weights.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            weights.write_bytes(bytes(raw))

    monkeypatch.setattr(pub, "fsync_path", fsync_then_corrupt)
    with pytest.raises(PublishError, match="does not match its sha256"):
        publish_files(copy_writer(adapter_files), tmp_path, "fam", 1)
    assert not adapter_path(tmp_path, "fam", 1).exists() and staging_entries(tmp_path) == []


def test_a_corrupted_adapter_folder_is_refused_by_the_runtime_check(peft_model, adapter_files: Path, tmp_path: Path) -> None:
    _, shapes = peft_model
    published = publish_files(copy_writer(adapter_files), tmp_path, "fam", 1)
    weights = published.path / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01  # inside the tensor data: safetensors still parses, only the hash tells
    weights.write_bytes(bytes(raw))
    with pytest.raises(AdapterInvalid, match="adapter_model.safetensors is missing or does not match its sha256"):
        validate_adapter(published.path, base_shapes=shapes, max_rank=8, adapter_root=tmp_path)
    with pytest.raises(PublishError, match="does not match"):
        verify_manifest(published.path)


KILL_SCRIPT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from learner.publish import publish_files
src, root = Path(sys.argv[1]), Path(sys.argv[2])
def write(dest):
    for i, f in enumerate(sorted(src.iterdir())):
        (dest / f.name).write_bytes(f.read_bytes())
        if i == 0:
            print("PARTIAL", flush=True)
            time.sleep(600)
publish_files(write, root, "fam", 7)
print("PUBLISHED", flush=True)
"""


def test_a_publish_killed_midway_leaves_no_adapter_and_is_cleaned(peft_model, adapter_files: Path, tmp_path: Path) -> None:
    _, shapes = peft_model
    script = tmp_path / "publish.py"
    script.write_text(KILL_SCRIPT.format(root=str(ROOT)))
    root = tmp_path / "adapters"
    proc = subprocess.Popen([sys.executable, str(script), str(adapter_files), str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line.startswith("PARTIAL"):
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(proc.stderr.read() if proc.stderr else "exited")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not adapter_path(root, "fam", 7).exists()
    leftovers = staging_entries(root)
    assert len(leftovers) == 1 and leftovers[0].name.startswith(f"fam@7-{proc.pid}-")
    staged = [p.name for p in leftovers[0].iterdir()]
    assert len(staged) == 1 and "manifest.json" not in staged  # killed after its first file
    # the next start removes it, and a fresh publish of the same version completes and validates
    assert clean_staging(root) == leftovers and staging_entries(root) == []
    done = publish_files(copy_writer(adapter_files), root, "fam", 7)
    validate_adapter(done.path, base_shapes=shapes, max_rank=8, adapter_root=root, expected_sha256=done.manifest_sha256)


def test_clean_staging_keeps_a_live_publisher(tmp_path: Path) -> None:
    live = tmp_path / ".staging" / f"fam@3-{os.getppid()}-abc"  # our parent process is alive (and is not us)
    dead = tmp_path / ".staging" / "fam@4-999999999-abc"  # no such pid
    mine = tmp_path / ".staging" / f"fam@5-{os.getpid()}-abc"  # our own leftover: no publish of ours is in flight
    junk = tmp_path / ".staging" / "not-a-staging-name"
    for p in (live, dead, mine, junk):
        p.mkdir(parents=True)
    removed = clean_staging(tmp_path)
    assert sorted(removed) == sorted([dead, mine, junk])
    assert live.exists()


# ---------------------------------------------------------------------------------------------------
# RuntimeAdmin against httpx.MockTransport


def admin_with(handler) -> tuple[RuntimeAdmin, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request, len(seen))

    return RuntimeAdmin("http://runtime", "sekret", retries=3, backoff_s=0.0, transport=httpx.MockTransport(record)), seen


def test_admin_load_sends_the_contract_once(tmp_path: Path) -> None:
    admin, seen = admin_with(lambda req, n: httpx.Response(200, json={"name": "fam@3"}))
    assert admin.load(tmp_path / "fam" / "v3", "fam", 3, sha256="ab" * 32) == {"name": "fam@3"}
    (req,) = seen
    assert (req.method, req.url.path, req.headers["authorization"]) == ("POST", "/admin/adapters", "Bearer sekret")
    assert json.loads(req.content) == {
        "path": str(tmp_path / "fam" / "v3"),
        "family": "fam",
        "version": 3,
        "alias": False,
        "pinned": False,
        "sha256": "ab" * 32,
    }


def test_admin_retries_only_idempotent_calls() -> None:
    admin, seen = admin_with(
        lambda req, n: httpx.Response(503, json={"error": {"message": "busy", "code": "x"}}) if n < 3 else httpx.Response(200, json={"ok": True})
    )
    assert admin.experiment_status("exp1") == {"ok": True}
    assert [r.url.path for r in seen] == ["/admin/experiments/exp1"] * 3
    admin, seen = admin_with(lambda req, n: httpx.Response(503, json={"error": {"message": "busy", "code": "overloaded"}}))
    with pytest.raises(AdminError) as err:
        admin.load("/a/fam/v1", "fam", 1)
    assert len(seen) == 1 and err.value.status == 503 and err.value.code == "overloaded"
    admin, seen = admin_with(lambda req, n: httpx.Response(200, json={"object": "alias"}))
    assert admin.set_alias("fam", "fam@2") == {"object": "alias"}
    assert (seen[0].method, seen[0].url.path, json.loads(seen[0].content)) == ("PUT", "/admin/aliases/fam", {"target": "fam@2"})


def test_admin_errors_and_unavailable() -> None:
    admin, seen = admin_with(lambda req, n: httpx.Response(409, json={"error": {"message": "fam@1 exists", "code": "AdapterExists"}}))
    with pytest.raises(AdminError, match="fam@1 exists") as err:
        admin.set_alias("fam", "fam@1")
    assert len(seen) == 1 and err.value.code == "AdapterExists"  # a 4xx is an answer, not retried

    def refuse(req: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    admin, seen = admin_with(refuse)
    with pytest.raises(AdminUnavailable):
        admin.list_adapters()
    assert len(seen) == 3
    admin, seen = admin_with(refuse)
    with pytest.raises(AdminUnavailable):
        admin.create_experiment({"name": "e", "family": "fam", "arms": []})
    assert len(seen) == 1
