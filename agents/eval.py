"""``python -m agents.eval``: kept as an entry point for its users; the harness is ``experiments/agent_eval.py``.

The one library module allowed to import ``experiments`` (``tests/test_import_rules.py``: an entry shim).
"""

from __future__ import annotations

import sys

from experiments.agent_eval import main

if __name__ == "__main__":
    sys.exit(main())
