"""Repository-root conftest: makes the top-level packages importable when pytest runs from a checkout."""
