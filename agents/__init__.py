"""loopwise agents package (filled in by later issues)."""
