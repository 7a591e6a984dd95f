"""The publish contract: a published adapter folder's file names, its manifest, and the project's one file hash.

A published adapter folder (``<adapter_root>/<family>/v<version>``) holds peft's ``adapter_config.json``
and ``adapter_model.safetensors`` (plus whatever else peft writes) and ``manifest.json``, written last::

    {"format": 1, "family": "tools-agent", "version": 4, "created_at": 1764806400.0,
     "files": {"adapter_config.json": "<sha256>", "adapter_model.safetensors": "<sha256>", ...}, ...}

``learner/publish.py`` writes it (``AdapterManifest.dump``); ``runtime/adapters/validation.py`` reads it before
loading anything (``AdapterManifest.read``, then ``mismatched``); the manifest file's own sha256
(``manifest_sha256``) pins exactly those files when the learner asks the runtime to load the version.
Only ``files`` is required: a manifest written by another tool may omit the rest, list ``files`` as
``[{"path", "sha256"}]``, or carry more keys (the publisher's ``meta``: metrics, ``intermediate``), which are
kept. ``sha256_file`` is the one file hash of the project (also the model store's and the checkpoints').

Not here: writing or renaming folders (``learner/publish.py``), LoRA shape and path checks
(``runtime/adapters/validation.py``). Imports nothing else of the project and never torch, so the runtime may import it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FORMAT = 1


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks (each read and update hands the GIL back and forth: few, large ones)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_sha256(folder: Path) -> str:
    """The sha256 of a published folder's manifest: the ``sha256`` to pass when loading it."""
    return sha256_file(Path(folder) / MANIFEST_FILE)


class ManifestError(ValueError):
    """``manifest.json`` is missing, not JSON, or not a manifest; the message says which."""


class AdapterManifest(BaseModel):
    """``manifest.json``: which files a published adapter holds and their sha256 (lower-case hex)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    format: int = MANIFEST_FORMAT
    family: str | None = None
    version: int | None = None
    created_at: float | None = None
    files: dict[str, str]

    @field_validator("files", mode="before")
    @classmethod
    def _files_as_mapping(cls, value: Any) -> Any:
        if isinstance(value, list):  # the list form other tools write: [{"path": ..., "sha256": ...}]
            try:
                return {e["path"]: e["sha256"] for e in value}
            except (KeyError, TypeError) as exc:
                raise ValueError(f"a files entry is not {{'path', 'sha256'}}: {exc!r}") from exc
        return value

    @field_validator("files")
    @classmethod
    def _lower_case(cls, value: dict[str, str]) -> dict[str, str]:
        return {rel: digest.lower() for rel, digest in value.items()}

    @classmethod
    def read(cls, path: Path) -> AdapterManifest:
        """Parse a ``manifest.json`` file; raises ``ManifestError`` naming what is wrong."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{MANIFEST_FILE} is missing or not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ManifestError(f"{MANIFEST_FILE} is malformed (want {{'files': {{path: sha256}}}}): not an object")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ManifestError(f"{MANIFEST_FILE} is malformed (want {{'files': {{path: sha256}}}}): {exc}") from exc

    def dump(self) -> str:
        """The file's text: every key, sorted, one-space indent (what the publisher writes and hashes)."""
        return json.dumps(self.model_dump(), indent=1, sort_keys=True)

    def mismatched(self, folder: Path) -> list[str]:
        """The listed files under ``folder`` that are missing or whose sha256 differs (empty when all match).

        Callers that must refuse paths escaping ``folder`` check the entries first (``runtime/adapters/validation.py`` does).
        """
        bad = []
        for rel, digest in self.files.items():
            file = Path(folder) / rel
            if not file.is_file() or sha256_file(file) != digest:
                bad.append(rel)
        return bad
