"""File helpers shared by checkpoints (``trainer``) and adapter publishing (``publish``): fsync, and whether
the process that owns a temp folder is still alive. The file hash is ``learner.records.adapter_manifest.sha256_file``."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_alive(name: str) -> bool:
    """Whether the process named in a temp folder ``<anything>-<pid>-<hex>`` is running and is not this one.

    This process's own leftovers count as dead: nothing of ours is in flight while we clean.
    """
    try:
        pid = int(name.rsplit("-", 2)[-2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
