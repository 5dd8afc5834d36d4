"""The ledger: what moves between ranks, recorded by the collectives as it happens.

Each call counts its own tensor sizes when it is launched, and a wall clock from launch to ``wait()``
returning when it is waited for. Nothing here is estimated; budget/predicted/zero_table.py says what the layout
expects, and the budget shows the two side by side.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: int = 0  # the size of the full (gathered / reduced) tensor of each call
    seconds: float = 0.0  # this rank blocked on it: launching, and waiting (what compute did not hide)

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes


@dataclass
class Ledger:
    """Collective traffic by kind and by (kind, label), since the last ``reset()``. A call counts (and its
    bytes) when it is launched; its seconds when it is waited for, which may be later (async)."""

    by_kind: dict[str, CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))
    by_label: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))
    # (scope, kind): the same calls by the kind of group they ran in (comm/mesh.py: world, shard, replica, reshard)
    by_scope: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))
    by_call: dict[tuple[str, str, str], CollectiveTotals] = field(  # (scope, kind, label)
        default_factory=lambda: defaultdict(CollectiveTotals)
    )
    # (kind, dtype): what travelled, by its wire dtype ("float32"; "bfloat16" or "int8" for packed calls)
    by_dtype: dict[tuple[str, str], CollectiveTotals] = field(default_factory=lambda: defaultdict(CollectiveTotals))

    blocked_seconds: float = 0.0  # all seconds blocked on collectives since the ledger was made (reset keeps it)
    gathered_bytes: int = 0  # full buffers allocated right now by stage-3 unsharding
    gathered_peak: int = 0  # the most at once since the last reset_peak()

    def track_gathered(self, delta: int) -> None:
        self.gathered_bytes += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def reset_peak(self) -> None:
        self.gathered_peak = self.gathered_bytes

    def record_launch(self, kind: str, label: str, nbytes: int, scope: str = "world", dtype: str = "") -> None:
        self.by_kind[kind].add(nbytes)
        self.by_dtype[(kind, dtype)].add(nbytes)
        self.by_label[(kind, label)].add(nbytes)
        self.by_scope[(scope, kind)].add(nbytes)
        self.by_call[(scope, kind, label)].add(nbytes)

    def record_seconds(self, kind: str, label: str, seconds: float, scope: str = "world") -> None:
        self.blocked_seconds += seconds
        self.by_kind[kind].seconds += seconds
        self.by_label[(kind, label)].seconds += seconds
        self.by_scope[(scope, kind)].seconds += seconds
        self.by_call[(scope, kind, label)].seconds += seconds

    def snapshot(self) -> dict[tuple[str, str, str], tuple[int, int, float]]:
        """(count, bytes, seconds) by (scope, kind, label), to subtract a stretch (e.g. validation) later."""
        return {key: (t.count, t.bytes, t.seconds) for key, t in self.by_call.items()}

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_label.clear()
        self.by_scope.clear()
        self.by_call.clear()
        self.by_dtype.clear()
