"""Where each rank's time goes, per optimizer step: measured by the step clock, the ranks' arrivals exchanged.

``TimeMeter`` runs a ``StepClock`` (comm/step_clock.py, [Note: the step clock]) on the run's world Comm and,
every ``every`` steps, exchanges what each rank lived in those steps (one ``all_gather_object``, filed under
"budget"): when it reached each collective, when it was blocked on it, its seconds per unit. From that every
rank computes the same figures for every rank (on a GPU the device's seconds: ``on_the_device``):

    forward, backward   the units computing (by unit in ``time_by_unit``; recomputation counts in backward)
    optimizer           from the optimizer's step (after the closure) to the end of the step
    data                from the end of the last step to the start of this one's forward (the loader, the loop)
    waiting_for_ranks   blocked on a collective before the last rank of its group had reached it
    comm_exposed        blocked on a collective after that: its data was on the way, compute did not hide it
    comm_hidden         a collective in flight while this rank computed (not additive: it overlaps the rest);
                        gloo's point-to-point works (the verified wire's, the pairwise transport's) have no
                        future and say they are done only once waited for, so there a call counts up to its
                        wait (compare with the prediction's ``to_wait``, not its ``in_flight``)
    step                the whole step; the six parts above add up to it (the clock attributes every moment)

The same exchange names stragglers (budget/measured/stragglers.py) and, for one steady step, keeps every
event for the timeline picture (budget/timeline_picture.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from lightning_shardlab.budget.measured.stragglers import Stragglers, WindowSummary
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.step_clock import BLOCKED, CallTimes, StepClock, StepTimes

TIME_KEYS = ("step", "forward", "backward", "optimizer", "data", "comm_exposed", "waiting_for_ranks", "comm_hidden")
ADDITIVE = ("forward", "backward", "optimizer", "data", "comm_exposed", "waiting_for_ranks")
EVERY = 5  # steps between exchanges: a straggler is named after two windows, within 2 * EVERY steps


def _overlap_before(intervals: list[list[float]], t: float) -> float:
    """Seconds of ``intervals`` ([start, end] pairs) that lie before ``t``."""
    return sum(max(0.0, min(end, t) - start) for start, end in intervals)


def on_the_device(step: StepTimes) -> float:
    """On a GPU, put the device's seconds in ``step.seconds`` (the loader's stay the host's) and return by how much
    the device's blocked time scales the host's (each call's waits are split as the host saw them); 1 on a CPU."""
    if step.device is None:
        return 1.0
    device = step.device.seconds()
    host_blocked = sum(s for (c, _), s in step.seconds.items() if c == BLOCKED)
    for key in set(step.seconds) | set(device):
        if key[0] not in ("data", "other"):
            step.seconds[key] = device.get(key, 0.0)
    step.end = step.start + sum(step.seconds.values())  # the device's span and the loader's
    device_blocked = sum(s for (c, _), s in step.seconds.items() if c == BLOCKED)
    return device_blocked / host_blocked if host_blocked > 0 else 0.0


def step_summary(step: StepTimes, offset: float, world: int) -> dict[str, Any]:
    """What this rank sends of one step: wall-clock times (perf_counter + ``offset``), units' seconds."""
    units: dict[str, float] = defaultdict(float)
    for (category, subject), seconds in step.seconds.items():
        if subject is not None and category in ("forward", "backward"):
            units[f"{subject} {category}"] += seconds
    compute = sum(s for (c, _), s in step.seconds.items() if c in ("forward", "backward", "optimizer"))
    return {
        "arrivals": [c.arrival + offset for c in step.calls],
        "blocked": [[[s + offset, e + offset] for s, e in c.blocked] for c in step.calls],
        "groups": [c.ranks or tuple(range(world)) for c in step.calls],
        "labels": [f"{c.kind} {c.label}" for c in step.calls],
        "units": dict(units),
        "compute": compute,
        "step": step.end - step.start,
    }


def waiting_by_call(everyone: list[dict[str, Any]], rank: int) -> list[float]:
    """Seconds ``rank`` was blocked on each of its calls before the last rank of the call's group reached it."""
    mine = everyone[rank]
    if any(len(e["arrivals"]) != len(mine["arrivals"]) for e in everyone):
        return [0.0] * len(mine["arrivals"])  # the ranks' calls differ (the guard reports it): no split
    waits = []
    for i, group in enumerate(mine["groups"]):
        last = max(everyone[r]["arrivals"][i] for r in group)
        waits.append(_overlap_before(mine["blocked"][i], last))
    return waits


def _hidden(call: CallTimes) -> float:
    """In flight while this rank did something else: from its launch to its completion or its wait."""
    if call.completed is None:
        return 0.0
    waited = call.blocked[1][0] if len(call.blocked) > 1 else call.completed
    return max(0.0, min(call.completed, waited) - call.launched)


class TimeMeter:
    """The time side of the budget on one rank: a clock on the run's Comm, exchanged every ``every`` steps."""

    def __init__(self, comm: Comm, every: int = EVERY, picture_step: int = 2) -> None:
        self.comm, self.every, self.picture_step = comm, every, picture_step
        self.clock = StepClock(comm.device)
        comm.clock = self.clock
        self.stragglers = Stragglers(comm.world_size)
        self.clock.stragglers = self.stragglers.named  # the guard warns of them (guard/sanity_guard.py)
        self.reset()

    def reset(self, first_step: int = 0) -> None:
        """Forget the steps so far (the warm-up): what is reported starts here, after optimizer step ``first_step``
        (the picture's step is numbered from it)."""
        self.first_step = first_step
        self.clock.take()
        self._pending: list[StepTimes] = []
        self.totals: dict[str, float] = defaultdict(float)
        self.by_unit: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.by_collective: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps = 0
        self.timeline: dict[str, Any] | None = None

    def end_step(self) -> None:
        """Close the step; collective every ``every`` steps (the same steps on every rank)."""
        counted = self.steps + len(self._pending) + 1
        self.clock.record = counted + 1 == self.picture_step  # keep the next step's events for the picture
        self._pending.append(self.clock.end_step())
        if len(self._pending) >= self.every:
            self.exchange()

    def exchange(self) -> None:
        """Collective: every rank's summaries of the pending steps; account them, look for stragglers."""
        if not self._pending:
            return
        offset, world = self.clock.wall_offset, self.comm.world_size
        scales = [on_the_device(s) for s in self._pending]
        mine = [step_summary(s, offset, world) for s in self._pending]
        everyone = collectives.all_gather_object(mine, self.comm, label="step clock", kind="budget")
        summaries = []
        for i, step in enumerate(self._pending):
            ranks = [e[i] for e in everyone]
            summaries.append(WindowSummary(ranks, [waiting_by_call(ranks, r) for r in range(world)]))
            self._account(step, ranks, summaries[-1].waits[self.comm.rank], scales[i])
        self.stragglers.window(summaries)
        self._pending = []

    def _account(self, step: StepTimes, everyone: list[dict[str, Any]], waits: list[float], scale: float) -> None:
        self.steps += 1
        rank = self.comm.rank
        for (category, subject), seconds in step.seconds.items():
            if category == BLOCKED:
                continue
            self.totals["data" if category == "other" else category] += seconds
            if subject is not None and category in ("forward", "backward"):
                self.by_unit[subject][category] += seconds
        for call, waiting in zip(step.calls, waits):
            blocked = sum(e - s for s, e in call.blocked)
            entry = self.by_collective[call.kind]
            entry["waiting_for_ranks"] += waiting * scale
            entry["comm_exposed"] += (blocked - waiting) * scale
            entry["comm_hidden"] += _hidden(call)
        self.totals["step"] += step.end - step.start
        if step.events is not None:
            self.timeline = timeline_events(step, everyone, rank, self.clock.wall_offset)
            self.timeline["step"] = self.first_step + self.steps  # the optimizer step it was, counted from 1

    def report(self) -> dict[str, Any]:
        """Collective (the last exchange): this rank's seconds per step, and by unit, and the picture's step."""
        self.exchange()
        steps = max(self.steps, 1)
        totals = dict(self.totals)
        for key in ("waiting_for_ranks", "comm_exposed", "comm_hidden"):
            totals[key] = sum(c[key] for c in self.by_collective.values())
        measured = {k: totals.get(k, 0.0) / steps for k in TIME_KEYS}
        return {
            "time_measured": measured,
            "time_by_unit": {u: {k: v / steps for k, v in d.items()} for u, d in self.by_unit.items()},
            "time_by_collective": {c: {k: v / steps for k, v in d.items()} for c, d in self.by_collective.items()},
            "time_steps": self.steps,
            "stragglers": list(self.stragglers.named),
            "timeline": self.timeline,
        }

    def stop(self) -> None:
        if self.comm.clock is self.clock:
            self.comm.clock = None


def timeline_events(step: StepTimes, everyone: list[dict[str, Any]], rank: int, offset: float) -> dict[str, Any]:
    """One step of this rank as events on the wall clock: compute (and blocked, split) and the calls in flight."""
    events = []
    for category, subject, start, end in step.events or []:
        if category == BLOCKED:
            continue
        name = subject if subject is not None else category
        events.append({"name": name, "cat": "data" if category == "other" else category, "lane": "compute",
                       "start": start + offset, "dur": end - start})  # fmt: skip
    mine = everyone[rank]
    for i, call in enumerate(step.calls):
        name = f"{call.kind} {call.label}"
        end = (call.completed or call.launched) + offset
        events.append({"name": name, "cat": call.kind, "lane": "comm", "start": call.arrival + offset,
                       "dur": end - call.arrival - offset})  # fmt: skip
        last = max(everyone[r]["arrivals"][i] for r in mine["groups"][i]) if _same_calls(everyone) else float("-inf")
        for start, end in mine["blocked"][i]:
            cut = min(max(last, start), end)
            for cat, a, b in (("waiting_for_ranks", start, cut), ("comm_exposed", cut, end)):
                if b > a:
                    events.append({"name": name, "cat": cat, "lane": "compute", "start": a, "dur": b - a})
    events.sort(key=lambda e: e["start"])
    return {"step_seconds": step.end - step.start, "events": events}


def _same_calls(everyone: list[dict[str, Any]]) -> bool:
    return len({len(e["arrivals"]) for e in everyone}) == 1


def align_timelines(reports: list[dict[str, Any]]) -> None:
    """Rank 0, before drawing: every rank's picture step on one axis, from the earliest event of any rank."""
    timelines = [r["timeline"] for r in reports if r.get("timeline")]
    if not timelines:
        return
    origin = min(e["start"] for t in timelines for e in t["events"])
    for t in timelines:
        for e in t["events"]:
            e["start"] -= origin
