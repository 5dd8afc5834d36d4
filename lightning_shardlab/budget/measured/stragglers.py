"""Stragglers: a rank persistently slower than the others, named with where it is slow and where they wait.

Every exchange of the step clock (budget/measured/step_time.py) brings every rank's seconds per unit and
direction (``blocks.2 forward``), its compute in all, and its waits per collective, for a window of steps. A
rank is a candidate in a window when one of its units (or its compute as a whole) took ``RATIO`` times the
median of the other ranks' and the difference is at least ``SHARE`` of the median step: noise on a shared
machine moves single steps, not the sum over a window by that much. A candidate seen in two windows in a row
is named, once, as ``{"rank", "where", "ratio", "message"}``, the message saying where the others wait for it::

    rank 1: blocks.2 forward 2.1x the other ranks; ranks 0, 2, 3 wait 38 % of the step at all_gather blocks.3[float32]

Every rank computes the same list from the same exchanged figures, so every rank names the same stragglers.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

RATIO = 1.5  # a unit this many times the other ranks' median ...
COMPUTE_RATIO = 1.25  # ... or all of its compute this many times theirs ...
SHARE = 0.05  # ... and slower by at least this share of the median step
UNIT_SHARE = 0.6  # a unit holding this much of the compute's excess is where the rank is slow


@dataclass
class WindowSummary:
    """One step of every rank: its figures (step_time.step_summary) and its waits per call."""

    ranks: list[dict[str, Any]]
    waits: list[list[float]]  # by rank, by call: seconds blocked before the call's last rank arrived


def _sum(steps: list[WindowSummary], rank: int) -> dict[str, Any]:
    units: dict[str, float] = defaultdict(float)
    waits: dict[str, float] = defaultdict(float)
    out = {"units": units, "waits": waits, "compute": 0.0, "step": 0.0}
    for s in steps:
        mine = s.ranks[rank]
        for name, seconds in mine["units"].items():
            units[name] += seconds
        for label, seconds in zip(mine["labels"], s.waits[rank]):
            waits[label] += seconds
        out["compute"] += mine["compute"]
        out["step"] += mine["step"]
    return out


def _slowest(rank: int, sums: list[dict[str, Any]]) -> tuple[str, float] | None:
    """Where this rank is slow against the others' median: (where, ratio), or None. One unit when it holds most
    (``UNIT_SHARE``) of the excess of its compute; "compute" when the excess is spread over the units."""
    others = [s for r, s in enumerate(sums) if r != rank]
    step = statistics.median(s["step"] for s in sums)
    units = []
    for name, seconds in sums[rank]["units"].items():
        typical = statistics.median(o["units"].get(name, 0.0) for o in others)
        if typical > 0 and seconds >= RATIO * typical and seconds - typical >= SHARE * step:
            units.append((seconds - typical, name, seconds / typical))
    unit = max(units, default=None)
    typical, mine = statistics.median(o["compute"] for o in others), sums[rank]["compute"]
    spread = typical > 0 and mine >= COMPUTE_RATIO * typical and mine - typical >= SHARE * step
    if unit is not None and not (spread and unit[0] < UNIT_SHARE * (mine - typical)):
        return unit[1], unit[2]
    return ("compute", mine / typical) if spread else None


def _where_others_wait(rank: int, sums: list[dict[str, Any]]) -> str:
    others = [r for r in range(len(sums)) if r != rank]
    waits: dict[str, float] = defaultdict(float)
    for r in others:
        for label, seconds in sums[r]["waits"].items():
            waits[label] += seconds
    share = sum(waits.values()) / max(sum(sums[r]["step"] for r in others), 1e-12)
    at = max(waits, key=waits.get) if waits else "its collectives"
    return f"ranks {', '.join(map(str, others))} wait {share:.0%} of the step at {at}"


class Stragglers:
    """The candidates of the last window and the stragglers named so far (the same on every rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.named: list[dict[str, Any]] = []
        self._last: dict[int, tuple[str, float]] = {}  # rank -> (where, ratio) in the last window

    def window(self, steps: list[WindowSummary]) -> None:
        if self.world_size < 2 or not steps:
            return
        sums = [_sum(steps, r) for r in range(self.world_size)]
        seen = {}
        for rank in range(self.world_size):
            slow = _slowest(rank, sums)
            if slow is None:
                continue
            where, ratio = slow
            seen[rank] = (where, ratio)
            before = self._last.get(rank)
            if before is not None and before[0] == where and all(s["rank"] != rank for s in self.named):
                self._name(rank, where, (before[1] + ratio) / 2, sums)
        self._last = seen

    def _name(self, rank: int, where: str, ratio: float, sums: list[dict[str, Any]]) -> None:
        message = f"rank {rank}: {where} {ratio:.1f}x the other ranks; {_where_others_wait(rank, sums)}"
        self.named.append({"rank": rank, "where": where, "ratio": round(ratio, 2), "message": message})
