"""loopwise experiments: research drivers and harnesses around the product, not part of it.

The agent evaluation harness (``experiments.agent_eval``), the memory copilot's trainer and tournament
(``experiments.memory_train``, ``experiments.memory_tournament``) and the synthetic users of
``serve.py --demo`` (``experiments.demo_users``). They may import anything in the project; no library
package (``runtime``, ``agents``, ``memory``, ``tools``, ``learner``) imports them
(``tests/test_import_rules.py``). Each trainer goes through the learner's one update pipeline
(``learner/update.py``) rather than a loop of its own.
"""
