"""The memory store's server-level settings: ``[memory]`` in loopwise's root settings, ``serve.py``'s memory flags.

Declared once here (name, default, bounds, help; ``json_schema_extra={"flag": ...}`` names the flag):
``loopwise_settings.py`` (the root settings, beside ``serve.py``) embeds :class:`MemorySettings` as its ``memory`` section,
and ``serve.py``'s flags are generated from these fields. :data:`MAX_MEMORY_CHARS`, the longest memory text, is the one number behind the
store's default limit (here and in ``memory/store.py``) and the bound on an agent's ``memory.max_chars``
(``memory/config.py``).

Imports only pydantic and the standard library, so the root settings embed it, and ``serve.py`` parses its flags,
without importing the memory package (``tests/test_import_rules.py``).

Not here: an agent's memory options (``memory/config.py``), the store itself (``memory/store.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_MEMORY_CHARS = 16_000
"""The longest memory text: the store's default limit and the most an agent's memory config may ask for."""
KEEP_VERSIONS = 20
"""Memory versions the store keeps per document by default."""


class MemorySettings(BaseModel):
    """Agent memory (``memory/``): the versioned store in ``<data-dir>/memory.db``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_versions: int = Field(
        KEEP_VERSIONS,
        ge=1,
        description="memory versions kept per document (older ones are deleted)",
        json_schema_extra={"flag": "--memory-keep-versions"},
    )
    max_chars: int = Field(
        MAX_MEMORY_CHARS, ge=1, description="longest memory text the store accepts", json_schema_extra={"flag": "--memory-max-chars"}
    )
