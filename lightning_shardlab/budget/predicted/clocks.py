"""The two clocks a step is played on (budget/predicted/step_time.py): one compute stream, and each link a first-in-
first- out queue of collectives. Compute advances the clock; a collective joins its link's queue when launched and moves
at full speed while compute waits for it, at ``share`` of that while compute runs; a wait blocks compute until the call
is through. What a call costs its host (on a CPU, the cores its communication threads take) is paid as compute where
compute runs while it is pending, and as waiting where it is waited for before any compute: back-to-back calls (the
refresh, the end of backward) have no compute to slow (benchmarks/TIME_PREDICTION.md, "Ways to price a call": the steps
the same, the parts closer). Likewise a call's messages take the latency its link shows calls waited for back to back,
or, if compute runs while it is pending, a busy rank's (``Interconnect.busy_latency``). What it tallies: by collective
kind, the seconds on the wire, exposed (waited for), hidden (in flight before the wait) and in flight; by part of the
step, the compute launching calls took; and the played step as events, as the timeline picture draws one
(budget/timeline_picture.py).
"""

from __future__ import annotations

from typing import Any


class Timeline:
    """One compute stream and first-in-first-out links: each wait advances the clock to the collective's end.

    A link works at full speed while compute waits, and at ``share`` of it while compute runs (1: links of their own,
    as a GPU's; 0: a CPU whose cores all compute, where a collective moves only while its rank is blocked)."""

    def __init__(self, share: float = 1.0) -> None:
        self.now = 0.0  # seconds
        self.share = share
        self.queues: dict[str, list[list]] = {}  # link -> [key, seconds of work left at full speed], in order
        self.pending: dict[tuple[str, str], tuple[str, float]] = {}  # (what, unit) -> (kind, launched)
        self.ended: dict[tuple[str, str], float] = {}  # calls done, not yet waited for -> when they ended
        self.wire: dict[str, float] = {}  # kind -> seconds on the wire
        self.exposed: dict[str, float] = {}  # kind -> seconds compute waited for it
        self.hidden: dict[str, float] = {}  # kind -> seconds each call flew before its wait (queued behind others too)
        self.to_wait: dict[str, float] = {}  # kind -> seconds from each launch to the end of its wait
        self.in_flight: dict[str, float] = {}  # kind -> seconds from each launch to its end (queued behind others too)
        self.phase = "forward"  # the part of the step compute is in: what launching a call is charged to
        self.launching: dict[str, float] = {}  # part -> host seconds spent launching calls
        self.owed: dict[tuple[str, str], float] = {}  # launched calls whose cost to the host is not paid yet
        self.beside: dict[tuple[str, str], float] = {}  # launched calls' latency if their rank computes beside them
        self.events: list[dict[str, Any]] = []  # the step as the timeline picture draws one (timeline_picture.py)

    def _advance(self, seconds: float, speed: float) -> None:
        """The links work for the next ``seconds`` at ``speed`` x their own; calls that finish are noted."""
        if speed <= 0:
            return
        for queue in self.queues.values():
            at, work = self.now, seconds * speed
            while queue and work > 0:
                call = queue[0]
                done = min(call[1], work)
                call[1], work, at = call[1] - done, work - done, at + done / speed
                if call[1] <= 1e-12:
                    self.ended[queue.pop(0)[0]] = at

    def compute(self, seconds: float, cat: str = "", name: str = "") -> None:
        """Compute for ``seconds``: drawn as ``cat`` (forward, backward, optimizer, data; default: the phase) of
        ``name`` (a unit, or the call being launched); first, what the calls launched before it cost the host."""
        if seconds > 0 and self.beside:
            self._computed_beside()
        if seconds > 0 and self.owed:
            owed, self.owed = self.owed, {}
            for key, host in owed.items():
                self.launching[self.phase] = self.launching.get(self.phase, 0.0) + host
                self.compute(host, name=f"launch {self.pending[key][0]} {key[1]}")
        if seconds > 0:
            self.events.append({"name": name or cat or self.phase, "cat": cat or self.phase, "lane": "compute",
                                "start": self.now, "dur": seconds})  # fmt: skip
        self._advance(seconds, self.share)
        self.now += seconds

    def _computed_beside(self) -> None:
        """Compute begins while calls are pending: each still queued takes its busy latency (``beside``) on top."""
        beside, self.beside = self.beside, {}
        for queue in self.queues.values():
            for call in queue:
                if call[0] in beside:
                    call[1] += beside[call[0]]
                    self.wire[self.pending[call[0]][0]] += beside[call[0]]

    def launch(
        self, key: tuple[str, str], kind: str, link: str, seconds: float, host: float = 0.0, beside: float = 0.0
    ) -> None:
        """The call enters its link's queue. What it costs the host (``host`` seconds: on a CPU, the cores its
        communication threads take) is paid as compute if compute runs before its wait, else in its wait; and if
        compute runs while it is pending, its messages take a busy rank's latency (``beside`` seconds more)."""
        if seconds <= 0 or key in self.pending:
            return
        if host > 0:
            self.owed[key] = host
        if beside > 0:
            self.beside[key] = beside
        self.queues.setdefault(link, []).append([key, seconds])
        self.pending[key] = (kind, self.now)
        self.wire[kind] = self.wire.get(kind, 0.0) + seconds

    def wait(self, key: tuple[str, str]) -> None:
        if key not in self.pending:
            return
        kind, launched = self.pending[key]
        host = self.owed.pop(key, 0.0)
        self.beside.pop(key, None)  # waited for before any compute: back to back
        if host:  # nothing computed since its launch: the rank waits while the call costs it
            self.events.append({"name": f"{kind} {key[1]}", "cat": "comm_exposed", "lane": "compute",
                                "start": self.now, "dur": host})  # fmt: skip
            self.exposed[kind] = self.exposed.get(kind, 0.0) + host
            self.now += host
        del self.pending[key]
        waited = self.now
        if key not in self.ended:  # blocked: every link at full speed until this call is through
            queue = next(q for q in self.queues.values() if any(call[0] == key for call in q))
            ahead = 0.0
            for call in queue:
                ahead += call[1]
                if call[0] == key:
                    break
            self._advance(ahead, 1.0)
            self.now += ahead
            if key not in self.ended:  # rounding left a sliver of it
                queue.remove(next(call for call in queue if call[0] == key))
                self.ended[key] = self.now
        end = self.ended.pop(key)
        name = f"{kind} {key[1]}"
        self.events.append({"name": name, "cat": kind, "lane": "comm", "start": launched, "dur": end - launched})
        self.in_flight[kind] = self.in_flight.get(kind, 0.0) + end - launched
        self.hidden[kind] = self.hidden.get(kind, 0.0) + min(end, waited) - launched
        self.to_wait[kind] = self.to_wait.get(kind, 0.0) + max(end, waited) - launched
        if end > waited:
            self.events.append({"name": name, "cat": "comm_exposed", "lane": "compute", "start": waited,
                                "dur": end - waited})  # fmt: skip
            self.exposed[kind] = self.exposed.get(kind, 0.0) + end - waited
