"""Which adapter version serves a request: LoRA adapters as immutable versions ``family@N`` with aliases, and the A/B
experiments between them.

- ``names``: ``AdapterRef``, the adapter errors and model-name parsing (base, ``family@N``, alias);
- ``registry``: loaded versions, aliases, acquire/release around every request, unload only once drained;
- ``validation``: a published folder checked against the base model and its manifest before any load;
- ``sync``: runtimes on one PostgreSQL store follow its adapters, aliases and experiments;
- ``routing``: the routing decision (base, version, alias, A/B arm, a session's pinned version) and the sticky arm hash;
- ``experiments`` and ``experiment_stats``: A/B experiments, their always-valid tests and automatic decisions.

Not here: the admin API over them (``runtime/admin/adapters.py``), loading weights (the engines).
"""
