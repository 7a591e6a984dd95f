"""loopwise memory package (filled in by later issues)."""
