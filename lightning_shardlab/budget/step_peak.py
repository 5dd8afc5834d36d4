"""The step's peak of tensor memory by phase (forward, backward, optimizer step), measured on one step.

Everything a rank holds at once — model state, gathered units, activations, temporaries — peaks somewhere in
a step; the budget's other figures are taken between steps. For one training step (the first after the
warm-up) ``StepPeak`` measures the largest total of live tensor bytes inside each phase:

- on a GPU, from the allocator: ``torch.cuda.max_memory_allocated``, its peak reset as each phase begins;
- on CPU, which has no allocator statistics, by tensor accounting: the step runs under torch's profiler with
  ``profile_memory=True``, whose memory timeline (``torch.profiler._memory_profiler``) lists every allocation
  and free with its category (parameter, gradient, optimizer state, activation, temporary, ...); the phases
  are ``record_function`` ranges opened and closed from the budget's hooks, and each phase's peak is the
  largest live total between its start and end (tensors alive before the step count from the start).

The profiled step runs slower (the profiler records every op), so it is left out of the timings; it is the first
step after the warm-up (optimizer state made, prefetch order known), and it is opt-in:
``ShardLabBudget(step_peak=True)``.
"""

from __future__ import annotations

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

    def start(self, first: str = PHASES[0]) -> None:
        """The step begins with phase ``first`` (a Fabric loop, whose phases the budget does not see: "step")."""
        if self.device.type != "cuda":
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
            )
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
        """Per phase that ran: ``{"peak": bytes, "by_category": {category: bytes at that peak}}``."""
        self._close()
        if self.device.type == "cuda":
            return {name: {"peak": peak, "by_category": {}} for name, peak in self.gpu_peaks.items()}
        self.profiler.__exit__(None, None, None)
        return phase_peaks(self.profiler)


def phase_peaks(profiler: Any) -> dict[str, dict[str, Any]]:
    """Each marked phase's largest live CPU total in a profiled step, with its breakdown by category."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    memory = profiler._memory_profile()
    windows = {}
    for event in memory._op_tree.dfs():
        name = _name(event)
        if name.startswith("shardlab::phase "):
            windows[name.removeprefix("shardlab::phase ")] = (event.start_time_ns / 1000, event.end_time_ns / 1000)
    times, sizes = MemoryProfileTimeline(memory)._coalesce_timeline("cpu")
    # column 0 is never filled; column i + 1 is the i-th category of the profiler's order (None: uncategorised)
    names = ["-", *(c.name.lower() if c is not None else "other" for c in _CATEGORY_TO_INDEX)]
    out = {}
    for name, (start, end) in windows.items():
        rows = [row for t, row in zip(times, sizes) if start <= t <= end] or [_before(times, sizes, start)]
        peak = max(rows, key=sum)
        out[name] = {"peak": int(sum(peak)), "by_category": {n: int(b) for n, b in zip(names, peak) if b}}
    return out


def _name(event: Any) -> str:
    """An event's name; "" for one whose name the profiler cannot decode (seen on events of other threads)."""
    try:
        return event.name
    except UnicodeDecodeError:
        return ""


def _before(times: list[int], sizes: list[list[int]], start: float) -> list[int]:
    """The live sizes when a phase with no allocation of its own began."""
    earlier = [row for t, row in zip(times, sizes) if t <= start]
    return earlier[-1] if earlier else [0] * (len(sizes[0]) if sizes else 1)
