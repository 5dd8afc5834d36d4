"""The step's peak of tensor memory by phase (forward, backward, optimizer step), measured on one step.

Everything a rank holds at once — model state, gathered units, activations, temporaries — peaks somewhere in
a step; the budget's other figures are taken between steps. For one training step (the first after the
warm-up) ``StepPeak`` measures the largest total of live tensor bytes inside each phase:

- on a GPU, from the allocator: ``torch.cuda.max_memory_allocated``, its peak reset as each phase begins;
- on CPU, which keeps no allocator statistics, by accounting: what is live when the step starts, read from the
  real tensors (the engine's flat parameters, gradients, master weights, the optimizers' state, and the batch:
  budget/measured/memory.py), plus every allocation and free the step makes, as torch's profiler reports them with
  ``profile_memory=True`` (its ``Allocation`` events: each CPU allocation and free through torch's allocator,
  with its size), plus the frees of what was live at the start, which the profiler does not report (it knows
  the size of blocks allocated while it runs only): each of those storages is watched (``weakref.finalize``)
  and its free timed on the profiler's clock. The phases are ``record_function`` ranges opened and closed from
  the budget's hooks; a phase's peak is the start's bytes plus the largest running sum of those events within
  it. (The profiler's own per-tensor timeline leaves out tensors that live through the step without an op it
  follows, such as parts of the optimizer state, so it is not used for the total.)

The profiled step runs slower (the profiler records every op), so it is left out of the timings; it is the first
step after the warm-up (optimizer state made, prefetch order known), and it is opt-in:
``ShardLabBudget(step_peak=True)``.
"""

from __future__ import annotations

import bisect
import itertools
import time
import weakref
from typing import Any

import torch
from torch.autograd.profiler import record_function

PHASES = ("forward", "backward", "optimizer")


class StepPeak:
    """Measures one step: ``start()``, ``phase(name)`` at each boundary, ``stop()`` returns the figures."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.current: str | None = None
        self.mark: Any = None
        self.profiler: Any = None
        self.gpu_peaks: dict[str, int] = {}
        self.at_start = 0
        self.freed: list[tuple[int, int]] = []  # (ns, -bytes): the frees of what was live at the start (CPU)
        self._watched: list[weakref.finalize] = []

    def start(self, live: list[torch.UntypedStorage], first: str = PHASES[0]) -> None:
        """The step begins with phase ``first`` (a Fabric loop, whose phases the budget does not see: "step"), with
        the storages in ``live`` live (read from the real tensors; used on CPU)."""
        self.at_start = sum(storage.nbytes() for storage in live)
        if self.device.type != "cuda":
            self._watched = [weakref.finalize(storage, self._free, storage.nbytes()) for storage in live]
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        self.phase(first)

    def phase(self, name: str) -> None:
        """``name`` begins (the phase before it ends)."""
        self._close()
        self.current = name
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.mark = record_function(f"shardlab::phase {name}")
        self.mark.__enter__()

    def _close(self) -> None:
        if self.mark is None:
            return
        self.mark.__exit__(None, None, None)
        self.mark = None
        if self.device.type == "cuda" and self.current is not None:
            self.gpu_peaks[self.current] = torch.cuda.max_memory_allocated(self.device)

    def stop(self) -> dict[str, dict[str, Any]]:
        """Per phase that ran: ``{"peak": bytes, "by_category": {...}}`` (on CPU: live at the step's start, and
        made in the step up to the peak; on a GPU, the allocator's peak without parts)."""
        self._close()
        if self.device.type == "cuda":
            return {name: {"peak": peak, "by_category": {}} for name, peak in self.gpu_peaks.items()}
        self.profiler.__exit__(None, None, None)
        for watched in self._watched:
            watched.detach()
        return phase_peaks(self.profiler, self.at_start, self.freed)

    def _free(self, nbytes: int) -> None:
        self.freed.append((time.time_ns(), -nbytes))  # the profiler's events are timed in ns since the epoch


def phase_peaks(profiler: Any, at_start: int, freed: list[tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Each marked phase's largest live CPU total in a profiled step: ``at_start`` plus the running sum of the
    step's allocations (+) and frees (-), ``freed`` among them, at its largest inside the phase."""
    from torch.profiler._memory_profiler import OpTree, _EventType

    # the profiled events as a tree (what torch's memory profile starts from; its categories are not needed here)
    windows, allocations = {}, []
    for event in OpTree(profiler.profiler.kineto_results).dfs():
        name = _name(event)
        if name.startswith("shardlab::phase "):
            windows[name.removeprefix("shardlab::phase ")] = (event.start_time_ns, event.end_time_ns)
        elif event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            allocations.append((event.start_time_ns, event.typed[1].ptr, event.typed[1].alloc_size))
    changes = _made_here(allocations)
    begin = min((start for start, _ in windows.values()), default=0)
    changes = sorted(change for change in [*changes, *freed] if change[0] >= begin)
    times = [t for t, _ in changes]
    running = list(itertools.accumulate(nbytes for _, nbytes in changes))  # made since the step began
    out = {}
    for name, (start, end) in windows.items():
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        made = max([running[lo - 1] if lo else 0, *running[lo:hi]])
        out[name] = {"peak": at_start + made, "by_category": {"live at the step's start": at_start, "made in it": made}}
    return out


def _made_here(allocations: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(ns, bytes) of the profiled allocations, and of the frees of blocks allocated while it ran. [Note: stale
    sizes] torch's CPU allocator remembers a block's size when it is allocated under a profiler and forgets it only
    when it is freed under one; a block made under an earlier profiler (another fit's profiled step in the same
    process) and freed without one leaves its address behind, and a later block at that address, live at this
    step's start, is reported freed with the old size. Those frees are the watched storages' (``freed``), timed
    by their finalizers: counting the profiler's too would count them twice, at a stale size."""
    made, out = set(), []
    for ns, ptr, nbytes in sorted(allocations):
        if nbytes > 0:
            made.add(ptr)
        elif ptr not in made:
            continue
        else:
            made.discard(ptr)
        out.append((ns, nbytes))
    return out


def _name(event: Any) -> str:
    """An event's name; "" for one whose name the profiler cannot decode (seen on events of other threads)."""
    try:
        return event.name
    except UnicodeDecodeError:
        return ""
