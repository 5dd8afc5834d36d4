"""The budget as a picture: one stacked bar per rank of what it holds at the step's peak, measured.

Bottom to top: parameters, gradients, master, optimizer state (between steps), the gathered peak (units
gathered at once at stage 3), and the activations saved for backward at the peak forward
(budget/measured/activations.py). Written by rank 0 beside ``shardlab_budget.json`` as ``shardlab_budget.png`` when
matplotlib is installed (the ``plot`` extra); drawn on a ``Figure`` of its own, so nothing global changes in the
user's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEGMENTS = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("master", "master"),
    ("optimizer_state", "optimizer state"),
    ("gathered_peak", "gathered (peak)"),
    ("activations", "activations (peak)"),
)


def segments(report: dict[str, Any]) -> dict[str, int]:
    """One rank's bar: bytes per segment, measured."""
    memory = report["memory_measured"]
    values = {key: int(memory.get(key, 0)) for key, _ in SEGMENTS if key != "activations"}
    values["activations"] = int((report.get("activations_measured") or {}).get("total", 0))
    return values


def write_bars(everyone: list[dict[str, Any]], path: Path) -> Path | None:
    """Draw every rank's bar into ``path`` (PNG); None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figure = Figure(figsize=(max(4.0, 1.2 * len(everyone) + 3), 4.5))
    axes = figure.add_subplot()
    ranks = [str(r["rank"]) for r in everyone]
    bottoms = [0.0] * len(everyone)
    for key, label in SEGMENTS:
        heights = [segments(r)[key] / 2**20 for r in everyone]
        axes.bar(ranks, heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    first = everyone[0]
    axes.set_title(f"at the step's peak: stage {first['stage']}, {first['precision']}", fontsize="medium")
    axes.set_xlabel("rank")
    axes.set_ylabel("MiB (measured)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
