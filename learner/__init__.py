"""loopwise learner package (filled in by later issues)."""
