"""loopwise tools package (filled in by later issues)."""
