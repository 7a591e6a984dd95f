"""Adapter names and the adapter error types: what a request's ``model`` routes to, before anything is loaded.

What it does:

- ``AdapterRef``: an immutable, versioned adapter name ``family@N`` (``tools-agent@7``); the family and
  version are checked when it is made.
- ``parse_model_name``: turns a request's ``model`` (base name, ``family``, ``family@N`` or SGLang's
  ``base:adapter``) into what to route to.
- The error types every adapter module raises::

    AdapterError(Exception)
    ├── AdapterNotFound     unknown name/alias, malformed model name, or removed from routing
    ├── AdapterExists       family@N already registered (versions are immutable)
    ├── AdapterInvalid      (also a ValueError) the folder fails validation; the message names the problem
    ├── AdapterInUse        alias target can't be unregistered; drain timed out
    └── AdapterCapacity     max_loaded reached and nothing is evictable

  They are separate from ``runtime.engine.AdapterError`` (an engine failure); the HTTP layer maps both.

What it does not: look at files (``runtime/adapters/validation.py``) or know what is loaded
(``runtime/adapters/registry.py``). Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAMILY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")


class AdapterError(Exception):
    """Base class of adapter naming, validation and registry errors."""


class AdapterNotFound(AdapterError):
    """No such adapter or alias is routable (or the model name is malformed)."""


class AdapterExists(AdapterError):
    """That ``family@N`` already names other weights; publish a new version."""


class AdapterInvalid(AdapterError, ValueError):
    """The adapter folder or name fails validation; the message names the problem."""


class AdapterInUse(AdapterError):
    """The adapter is an alias target, or its in-flight requests did not drain in time."""


class AdapterCapacity(AdapterError):
    """``max_loaded`` adapters are loaded and none can be evicted."""


@dataclass(frozen=True)
class AdapterRef:
    """One immutable adapter version; ``name`` (``family@version``) is its unique routing id."""

    family: str
    version: int
    path: str
    pinned: bool = False
    sha256: str | None = None

    def __post_init__(self) -> None:
        if not FAMILY_RE.match(self.family):
            raise AdapterInvalid(f"bad adapter family {self.family!r}: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise AdapterInvalid(f"bad adapter version {self.version!r}: must be an integer >= 1")

    @property
    def name(self) -> str:
        return f"{self.family}@{self.version}"


def parse_model_name(model: str, base_name: str) -> tuple[str, str | None]:
    """``base`` → ("base", None); ``fam`` → ("alias", "fam"); ``fam@N`` → ("version", "fam@N").

    SGLang's ``base:adapter`` is accepted when it starts with ``base_name + ":"``; the adapter part is
    resolved the same way. Anything else raises ``AdapterNotFound``.
    """
    if model == base_name:
        return "base", None
    rest = model[len(base_name) + 1 :] if model.startswith(base_name + ":") else model
    family, at, version = rest.partition("@")
    if FAMILY_RE.match(family) and (not at or _VERSION_RE.match(version)):
        return ("version", f"{family}@{int(version)}") if at else ("alias", family)
    raise AdapterNotFound(f"model {model!r} is neither {base_name!r}, an adapter family, family@N, nor {base_name}:<adapter>")
