"""The step clock: where one rank's time goes, attributed at the engine's own seams.

[Note: the step clock]

One rank's main thread is always doing exactly one thing, and the clock keeps a stack of what that is:

    bottom   the step's phase: ``data`` (waiting for the loader), ``forward``, ``backward``, ``optimizer``
             (set by whoever drives the step: ShardLabBudget from Lightning's hooks, or a Fabric loop)
    above    the unit computing (``forward``/``backward`` of ``blocks.3``: the engine's hooks push and pop it;
             recomputation under activation checkpointing runs inside the unit's backward, so it counts there)
    top      ``blocked`` on a collective (comm/collectives.py: launching it, and in ``wait()``)

At every change the seconds since the last one go to the top of the stack (one ``perf_counter`` per event), so
the parts of a step add up to the step by construction. A collective's blocked seconds are split afterwards,
once the ranks have exchanged when each of them reached it (``arrival``, the launch): the part before the last
rank of its group arrived is ``waiting_for_ranks`` (no data could have come sooner), the rest ``comm_exposed``
(the data was on its way, compute did not hide it). ``comm_hidden`` is the time a call was in flight while this
rank did something else: from its launch returning to the first of its completion (its works' futures'
callbacks note when, on gloo's threads; else ``Work.is_completed``, polled at each event) or its wait.

On a GPU the host's seams are not the device's time: kernels run after the host queued them, and a collective's
``wait()`` on NCCL returns once the compute stream is told to wait. There ``DeviceMarks`` records a CUDA event on the
current (compute) stream at every change too, so each (phase, unit) and each wait also gets the device's seconds:
the span between two events is what the stream ran for that entry, and the span across a wait is how long the
compute stream stalled for the collective. The events are read once per exchange (the last one waited for: one
host sync per window of steps, while the budget measures).

Clocks: times leave the rank as wall-clock seconds (``perf_counter`` + this process's offset to
``time.time()``, read once). Ranks on one machine read one clock, so their times line up to the reading's
jitter (microseconds); across machines they line up as well as the hosts' clocks are synchronised (NTP: about
a millisecond, PTP: microseconds), and a ``waiting_for_ranks`` below that error cannot be told from exposed
communication. On a GPU the engine's CPU-side seams measure what the host waits for, not the device's
streams: a collective's ``wait()`` on NCCL returns once the wait is queued.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_shardlab.comm.host_reads import wait_for

PHASES = ("data", "forward", "backward", "optimizer", "other")
BLOCKED = "blocked"


@dataclass
class CallTimes:
    """One collective as this rank lived it (seconds on this process's ``perf_counter``)."""

    kind: str
    label: str
    ranks: tuple[int, ...] | None  # the global ranks of its group (None: the world)
    arrival: float  # this rank reached it (its launch began)
    launched: float = 0.0  # its launch returned
    completed: float | None = None  # first seen complete, or its wait returned
    blocked: list[tuple[float, float]] = field(default_factory=list)  # this rank's main thread blocked on it
    works: list[Any] = field(default_factory=list)  # polled for completion while in flight
    done: list[float] = field(default_factory=list)  # when each work's future completed (its callback's time)

    def watch(self, works: list[Any]) -> None:
        """Note when each work completes: its future's callback runs on the backend's thread as it does (gloo);
        where a work has no future, ``poll`` at the clock's events sees it instead."""
        self.works = works
        for work in works:
            try:
                work.get_future().add_done_callback(lambda _: self.done.append(time.perf_counter()))
            except (AttributeError, RuntimeError):
                return

    def poll(self, now: float) -> bool:
        """True once complete (and notes when: its last work's callback, or the first event that saw it). A
        complete call lets go of its works: they hold its tensors, which must not outlive the engine's use."""
        if self.completed is None and self.works:
            if len(self.done) == len(self.works):
                self.completed = max(self.done)
            elif all(w.is_completed() for w in self.works):
                self.completed = max(self.done) if len(self.done) == len(self.works) else now
        if self.completed is not None:
            self.works = []
        return self.completed is not None


class DeviceMarks:
    """A CUDA event on the current stream at each change of a step's clock: the device's seconds per entry."""

    def __init__(self) -> None:
        self._marks: list[tuple[tuple[str, str | None] | None, Any]] = []  # (what ran up to it, its event)
        self.mark(None)

    def mark(self, ran: tuple[str, str | None] | None) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((ran, event))

    def seconds(self) -> dict[tuple[str, str | None], float]:
        """The device's seconds by entry (waits for the last event: a host sync)."""
        out: dict[tuple[str, str | None], float] = defaultdict(float)
        if len(self._marks) < 2:
            return out
        wait_for(self._marks[-1][1], "step clock")
        for (_, before), (ran, after) in zip(self._marks, self._marks[1:]):
            out[ran] += before.elapsed_time(after) / 1e3  # ms -> seconds
        return out


@dataclass
class StepTimes:
    """One step of one rank: seconds by (category, subject), its calls, and (if recorded) its events."""

    seconds: dict[tuple[str, str | None], float]
    calls: list[CallTimes]
    events: list[tuple[str, str | None, float, float]] | None  # (category, subject, start, end), perf_counter
    start: float
    end: float
    device: DeviceMarks | None = None  # on a GPU: the same entries' seconds on the device


class StepClock:
    """The stack of what this rank's main thread is doing, and the seconds each thing took this step."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.on_gpu = device is not None and device.type == "cuda"
        self.wall_offset = time.time() - time.perf_counter()  # perf_counter -> wall-clock seconds
        self.record = False  # keep this step's events (for the timeline picture)
        self.steps: list[StepTimes] = []  # finished steps since the last take()
        self.stragglers: list[dict[str, Any]] = []  # ranks named persistently slower (budget/measured/stragglers.py)
        self._begin(time.perf_counter())

    def _begin(self, now: float) -> None:
        self._stack: list[tuple[str, str | None]] = [("other", None)]
        self._since = self._start = now
        self._seconds: dict[tuple[str, str | None], float] = defaultdict(float)
        self._calls: list[CallTimes] = []
        self._in_flight: list[CallTimes] = []
        self._events: list[tuple[str, str | None, float, float]] | None = [] if self.record else None
        self._device = DeviceMarks() if self.on_gpu else None

    def _switch(self) -> float:
        now = time.perf_counter()
        top = self._stack[-1]
        self._seconds[top] += now - self._since
        if self._device is not None:
            self._device.mark(top)
        if self._events is not None and now > self._since:
            self._events.append((*top, self._since, now))
        self._since = now
        if self._in_flight:
            self._in_flight = [c for c in self._in_flight if not c.poll(now)]
        return now

    # ---- what the step's driver calls ----

    def phase(self, name: str) -> None:
        """The step enters ``name`` (one of PHASES): it replaces the bottom of the stack."""
        self._switch()
        self._stack[0] = (name, None)

    def end_step(self) -> StepTimes:
        """Close this step (the next one starts now, in ``data``) and keep it in ``steps``."""
        now = self._switch()
        for call in self._in_flight:
            call.completed = call.completed or now
            call.works = []
        step = StepTimes(dict(self._seconds), self._calls, self._events, self._start, now, self._device)
        self.steps.append(step)
        self._begin(now)
        self._stack[0] = ("data", None)
        return step

    def drop_step(self) -> None:
        """Forget what ran since the last ``end_step`` (validation inside fit, a warm-up): the next step starts now."""
        now = self._switch()
        phase = self._stack[0]
        self._begin(now)
        self._stack[0] = phase

    def take(self) -> list[StepTimes]:
        steps, self.steps = self.steps, []
        return steps

    # ---- what the engine calls ----

    def enter(self, category: str, subject: str | None) -> None:
        """A unit begins computing (``forward``/``backward``), on top of whatever ran (once: a unit announced
        again, e.g. the root's pre-backward from the loss and from its outputs, is already on the stack)."""
        self._switch()
        if (category, subject) not in self._stack:
            self._stack.append((category, subject))

    def leave(self, subject: str | None) -> None:
        """The unit ``subject`` stops computing (the topmost entry of it: backward is not always nested)."""
        self._switch()
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i][1] == subject and self._stack[i][0] != BLOCKED:
                del self._stack[i]
                return

    # ---- what the collectives call ----

    def arrive(self, kind: str, label: str, ranks: tuple[int, ...] | None) -> CallTimes:
        """A collective is reached: this rank blocks while launching it."""
        call = CallTimes(kind, label, ranks, self._switch())
        self._calls.append(call)
        self._stack.append((BLOCKED, f"{kind} {label}"))
        return call

    def launched(self, call: CallTimes, works: list[Any]) -> None:
        """Its launch returned: in flight until its wait (or done already, if it was waited for inside)."""
        call.launched = self._switch()
        call.blocked.append((call.arrival, call.launched))
        self._stack.pop()
        call.watch(works)
        self._in_flight.append(call)

    def block(self, call: CallTimes | None) -> float:
        now = self._switch()
        if call is not None:
            self._stack.append((BLOCKED, f"{call.kind} {call.label}"))
        return now

    def unblock(self, call: CallTimes | None, since: float) -> None:
        now = self._switch()
        if call is None:
            return
        self._stack.pop()
        call.blocked.append((since, now))
        call.poll(now)
        call.completed, call.works = min(call.completed or now, now), []
        if call in self._in_flight:
            self._in_flight.remove(call)


def clock_of(comm: Any) -> StepClock | None:
    """The clock running on this rank (shared by every group of a mesh), or None."""
    return (comm.parent or comm).clock
