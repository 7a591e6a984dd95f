"""loopwise agents: the agent loop over exact token ids, stop policies, T²PO, tasks with verifiers, and the host that serves agents.

Imports the runtime only through its client protocol (``runtime.agent_api``, ``runtime.engine``, ``runtime.identity``);
``docs/architecture.md`` has the layering.
"""
