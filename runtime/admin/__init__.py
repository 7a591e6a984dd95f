"""The loop's own HTTP surfaces beside the wire APIs: the admin API (``/admin``, the admin key) and the ``/v1``
routes around the learning loop that an API key reaches.

- ``store``: ``POST /v1/feedback``, ``DELETE /v1/sessions/{key}``, and the admin's feedback, stats, trajectories and
  session deletion over the interaction store;
- ``adapters``: adapter versions, aliases and A/B experiments (``/admin/adapters``, ``/admin/aliases``,
  ``/admin/experiments``);
- ``agents``: served agents' runs (``/v1/agents/{name}/runs``, ``/admin/agents/...``) and their configs;
- ``replay``: the learner's siblings of a recorded turn and unrecorded chat for its judges;
- ``memory``: agent memory documents (``/v1/memory``, ``/admin/memory``);
- ``learner``: the learners' state and update requests (``/admin/learner``) and their ``/metrics`` collector;
- ``traffic``: ``/admin/traffic``.

Each module holds a module-level ``router`` that ``runtime/app.py`` includes; handlers read the app's parts with
``runtime.services.services(request)`` and check the admin key first (``runtime.identity.check_admin_key``).

Not here: the generating wire APIs (``runtime/api/``), what the routes drive (the registry and experiments in
``runtime/adapters/``, the recorder, the agent host).
"""
