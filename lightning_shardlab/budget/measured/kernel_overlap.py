"""On a GPU: how much of each collective kind's kernel time ran while compute kernels ran, read from a profiler
trace (``torch.profiler``'s Chrome trace, rank by rank).

NCCL runs its collectives as kernels on streams of its own; whether they overlap compute is decided on the device,
so the host's clock cannot tell it. The trace can: every kernel is a complete event (``"ph": "X"``, category
``kernel``) with its start and duration on the device. A kernel whose name starts with ``nccl`` is communication,
named by its collective (``ncclDevKernel_AllGather_RING_LL``, ``ncclKernel_ReduceScatter_...``); every other kernel
is compute. For each kind: its kernels' time (the union of their intervals) and the part of it under the union of
the compute kernels' intervals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

KINDS = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}


def kernel_kind(name: str) -> str | None:
    """The collective a kernel runs (``all_gather``, ``reduce_scatter``, ``all_reduce``, or ``other`` for another
    NCCL kernel), or None for a compute kernel."""
    low = name.lower()
    if not low.startswith("nccl"):
        return None
    return next((kind for key, kind in KINDS.items() if key in low.replace("_", "")), "other")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap or touch, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(spans: list[Interval], cover: list[Interval]) -> float:
    """The length of ``spans`` that lies inside ``cover`` (both merged and in order)."""
    total, j = 0.0, 0
    for start, end in spans:
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            total += min(end, cover[k][1]) - max(start, cover[k][0])
            k += 1
    return total


def overlap_by_kind(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per collective kind in the trace's kernels: ``seconds`` of its kernels, ``hidden`` seconds of them under
    compute, and their ``fraction``. Empty when the trace holds no communication kernels (a CPU run)."""
    compute: list[Interval] = []
    comm: dict[str, list[Interval]] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))  # microseconds
        kind = kernel_kind(event.get("name", ""))
        (compute if kind is None else comm.setdefault(kind, [])).append(span)
    cover = union(compute)
    out = {}
    for kind, spans in sorted(comm.items()):
        merged = union(spans)
        seconds = sum(b - a for a, b in merged) / 1e6
        hidden = covered(merged, cover) / 1e6
        out[kind] = {"seconds": seconds, "hidden": hidden, "fraction": hidden / seconds if seconds else 0.0}
    return out


def overlap_in_trace(path: str | Path) -> dict[str, dict[str, float]]:
    """``overlap_by_kind`` of a Chrome trace file (``prof.export_chrome_trace(path)``)."""
    trace = json.loads(Path(path).read_text())
    return overlap_by_kind(trace["traceEvents"] if isinstance(trace, dict) else trace)
