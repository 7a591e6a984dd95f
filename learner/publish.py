"""Publish a trained LoRA adapter into the adapter root (two-phase, never half-published) and tell the runtime.

    published = publish_adapter(trainer.model, adapter_root, "tools-agent", 4)
    with RuntimeAdmin("http://127.0.0.1:8000", admin_key) as admin:
        admin.load(published.path, "tools-agent", 4, sha256=published.manifest_sha256)

Layout under the adapter root (the folder the runtime's ``--adapter-root`` points at)::

    <adapter_root>/<family>/v<version>/         a published adapter: never modified after the rename
        adapter_config.json                     peft's LoRA config
        adapter_model.safetensors               the LoRA weights
        README.md                               peft's model card (hashed like the rest)
        manifest.json                           {"format": 1, "family", "version", "created_at",
                                                 "files": {relpath: sha256}}  (written last)
    <adapter_root>/.staging/<family>@<version>-<pid>-<hex>/   a publish in progress

The protocol: write every file into a fresh staging folder, hash them, write the
manifest last, fsync the files and the folder, re-verify the staged files against the manifest, then
``os.rename`` the folder to ``<family>/v<version>`` (atomic on one file system; a non-empty target
makes it fail, so a published version is never overwritten) and fsync the parent. A crash or error at
any point leaves at most a staging folder, never a partial ``v<version>``; the failing call removes its
own staging folder, and ``clean_staging`` (run at the start of every publish and by the learner at
start-up) removes those of dead processes. ``runtime.adapters.validation.validate_adapter`` checks the manifest
hashes before the runtime loads anything, and the manifest's own sha256 pins the version in
``POST /admin/adapters``. The file names, the manifest model and the hash are the publish contract in
``learner/records/adapter_manifest.py``, which the runtime's validator reads too.

``RuntimeAdmin`` is a small synchronous httpx client of the runtime's admin API (adapters, aliases,
experiments). Only idempotent calls (GET, the alias PUT) are retried, a bounded number of times,
on connection errors and 502/503/504; a load or an experiment creation is sent once.

Errors::

    PublishError(RuntimeError)   the adapter could not be published (the final path was not created)
    AdminError(RuntimeError)     the runtime answered with an error (``status``, ``code``, ``message``)
    └── AdminUnavailable         no answer (connection refused, timeout) after the allowed tries

Not here: training, evaluation gates, deciding promotion. This module imports neither torch nor the runtime.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import structlog

from learner._files import fsync_path, writer_alive
from learner.records.adapter_manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    WEIGHTS_FILE,
    AdapterManifest,
    ManifestError,
    manifest_sha256,
    sha256_file,
)

log = structlog.get_logger(__name__)

STAGING_DIR = ".staging"


class PublishError(RuntimeError):
    """The adapter could not be published; nothing was created at the final path."""


class AdminError(RuntimeError):
    """The runtime's admin API answered with an error."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"admin API error {status} ({code}): {message}")
        self.status, self.code, self.message = status, code, message


class AdminUnavailable(AdminError):
    """The runtime's admin API did not answer."""


class _Savable(Protocol):
    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None: ...


@dataclass(frozen=True)
class PublishedAdapter:
    path: Path  # <adapter_root>/<family>/v<version>
    family: str
    version: int
    manifest_sha256: str  # pass as ``sha256`` when loading, so the runtime loads exactly these files
    files: dict[str, str]  # relpath → sha256

    @property
    def name(self) -> str:
        return f"{self.family}@{self.version}"


def adapter_path(adapter_root: Path, family: str, version: int) -> Path:
    """Where ``family@version`` is published."""
    return Path(adapter_root) / family / f"v{version}"


def _staged_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def verify_manifest(folder: Path) -> dict[str, str]:
    """The manifest's ``files`` after checking every listed file's sha256; raises ``PublishError``."""
    try:
        manifest = AdapterManifest.read(folder / MANIFEST_FILE)
    except ManifestError as exc:
        raise PublishError(f"{folder}: {exc}") from exc
    bad = manifest.mismatched(folder)
    if bad:
        raise PublishError(f"{folder / bad[0]} is missing or does not match its sha256 in {MANIFEST_FILE}")
    return dict(manifest.files)


def clean_staging(adapter_root: Path) -> list[Path]:
    """Remove staging folders of publishes whose process is gone (crashed or killed); returns them."""
    staging = Path(adapter_root) / STAGING_DIR
    if not staging.is_dir():
        return []
    removed = []
    for p in staging.iterdir():
        if not writer_alive(p.name):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    if removed:
        log.warning("removed unfinished adapter publishes", paths=[str(p) for p in removed])
    return removed


def publish_files(
    write: Callable[[Path], None], adapter_root: Path, family: str, version: int, *, meta: dict[str, Any] | None = None
) -> PublishedAdapter:
    """Publish whatever ``write(staging_folder)`` writes as ``family@version`` (see the module docstring)."""
    if version < 1:
        raise PublishError(f"adapter versions start at 1, got {version}")
    root = Path(adapter_root)
    final = adapter_path(root, family, version)
    if final.exists():
        raise PublishError(f"{final} already exists: versions are immutable, publish a new one")
    clean_staging(root)
    staging = root / STAGING_DIR / f"{family}@{version}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    try:
        write(staging)
        files = {p.relative_to(staging).as_posix(): sha256_file(p) for p in _staged_files(staging)}
        missing = {CONFIG_FILE, WEIGHTS_FILE} - files.keys()
        if missing:
            raise PublishError(f"the adapter writer did not produce {sorted(missing)} in {staging}")
        manifest = AdapterManifest.model_validate(
            {**(meta or {}), "format": MANIFEST_FORMAT, "family": family, "version": version, "created_at": time.time(), "files": files}
        )
        for p in _staged_files(staging):
            fsync_path(p)
        (staging / MANIFEST_FILE).write_text(manifest.dump())  # last
        fsync_path(staging / MANIFEST_FILE)
        fsync_path(staging)
        verify_manifest(staging)  # what is renamed is exactly what was hashed
        manifest_sha = manifest_sha256(staging)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, final)
        except OSError as exc:
            raise PublishError(f"could not move {staging} to {final}: {exc}") from exc
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("adapter published", adapter=f"{family}@{version}", path=str(final), manifest_sha256=manifest_sha)
    return PublishedAdapter(path=final, family=family, version=version, manifest_sha256=manifest_sha, files=files)


def publish_adapter(model: _Savable, adapter_root: Path, family: str, version: int, *, meta: dict[str, Any] | None = None) -> PublishedAdapter:
    """Save a peft model's LoRA adapter (safetensors) and publish it as ``family@version``."""
    return publish_files(lambda d: model.save_pretrained(str(d), safe_serialization=True), adapter_root, family, version, meta=meta)


# ---------------------------------------------------------------------------------------------------
# the runtime's admin API

RETRY_STATUS = (502, 503, 504)


class RuntimeAdmin:
    """Synchronous client of the runtime's admin API (``Authorization: Bearer <admin key>``)."""

    def __init__(
        self,
        base_url: str,
        admin_key: str,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {admin_key}"}, timeout=timeout, transport=transport
        )
        self._retries, self._backoff = retries, backoff_s

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RuntimeAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, url: str, *, idempotent: bool, json_body: dict[str, Any] | None = None) -> dict[str, Any]:
        tries = self._retries if idempotent else 1
        for attempt in range(1, tries + 1):
            try:
                resp = self._client.request(method, url, json=json_body)
            except httpx.TransportError as exc:
                if attempt == tries:
                    raise AdminUnavailable(0, f"{method} {url}: {exc}", "unavailable") from exc
                log.warning("admin call failed, retrying", method=method, url=url, attempt=attempt, error=str(exc))
            else:
                if resp.status_code in RETRY_STATUS and attempt < tries:
                    log.warning("admin call answered an error, retrying", status=resp.status_code, method=method, url=url, attempt=attempt)
                elif resp.is_error:
                    raise _admin_error(resp)
                else:
                    body: dict[str, Any] = resp.json()
                    return body
            time.sleep(self._backoff * 2 ** (attempt - 1))
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def list_adapters(self) -> dict[str, Any]:
        return self._call("GET", "/admin/adapters", idempotent=True)

    def load(
        self, path: Path | str, family: str, version: int, *, alias: bool = False, pinned: bool = False, sha256: str | None = None
    ) -> dict[str, Any]:
        """Load a published adapter as ``family@version`` (not retried: a repeat would be a different request)."""
        body: dict[str, Any] = {"path": str(path), "family": family, "version": version, "alias": alias, "pinned": pinned}
        if sha256 is not None:
            body["sha256"] = sha256
        return self._call("POST", "/admin/adapters", idempotent=False, json_body=body)

    def set_alias(self, family: str, target: str) -> dict[str, Any]:
        """Point the family's alias at ``target`` (``family@N``); idempotent, so retried."""
        return self._call("PUT", f"/admin/aliases/{family}", idempotent=True, json_body={"target": target})

    def create_experiment(self, config: dict[str, Any]) -> dict[str, Any]:
        """``POST /admin/experiments`` with the runtime's experiment fields (name, family, arms, ...); sent once."""
        return self._call("POST", "/admin/experiments", idempotent=False, json_body=config)

    def experiment_status(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/admin/experiments/{name}", idempotent=True)


def _admin_error(resp: httpx.Response) -> AdminError:
    try:
        err = resp.json().get("error", {})
        message, code = str(err.get("message", resp.text)), err.get("code")
    except (ValueError, AttributeError):
        message, code = resp.text, None
    return AdminError(resp.status_code, message, code)
