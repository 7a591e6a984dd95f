"""loopwise memory: versioned per-owner memory documents, update methods, the MemoPilot copilot and game testbeds.

Serves through the runtime's client protocol (``runtime.agent_api``); ``docs/architecture.md`` has the layering.
"""
