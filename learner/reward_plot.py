"""The learner's reward plot: ``reward.png`` from its ``history.jsonl`` (matplotlib, headless, imported only when drawn).

Not here: writing the history (``learner/service.py``, ``learner/release.py``).
"""

from __future__ import annotations

import json
from pathlib import Path


def plot_rewards(folder: Path, family: str) -> None:
    """``<folder>/reward.png`` from ``<folder>/history.jsonl``: mean reward of the trained samples per update, and the gate's held-out success."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    trained = [r for r in rows if r["metrics"]]  # held versions' publish lines carry no metrics
    ax.plot([r["version"] for r in trained], [r["metrics"].get("reward_mean", 0.0) for r in trained], marker="o", label="train reward")
    gated = [(r["version"], r["gate"]["new_success"]) for r in rows if "new_success" in r.get("gate", {})]
    if gated:
        ax.plot(*zip(*gated, strict=True), marker="s", label="held-out success (gate)")
    ax.set_xlabel("version")
    ax.set_ylabel("reward")
    ax.set_title(f"{family}: reward per update")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "reward.png", dpi=90)
    plt.close(fig)
