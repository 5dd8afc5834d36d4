"""The budget: what moves between ranks, recorded by the collectives as it happens.

Every number here comes from a real call (the collective's own tensor sizes and a wall clock around
its wait); nothing is estimated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: int = 0  # the size of the full (gathered / reduced) tensor of each call
    seconds: float = 0.0  # launch to wait() returning, as this rank saw it

    def add(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds


@dataclass
class Ledger:
    """Collective traffic by kind and by (kind, label), since the last ``reset()``."""

    by_kind: dict[str, CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))
    by_label: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))

    def record_collective(self, kind: str, label: str, nbytes: int, seconds: float) -> None:
        self.by_kind[kind].add(nbytes, seconds)
        self.by_label[(kind, label)].add(nbytes, seconds)

    def counts(self) -> dict[str, int]:
        return {kind: totals.count for kind, totals in self.by_kind.items()}

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_label.clear()
