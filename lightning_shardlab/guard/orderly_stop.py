"""SIGTERM stops every rank after the same step.

A scheduler that preempts a job may signal one rank, or all of them at slightly different moments. If
each rank simply stopped where it was, the others would wait forever in the next collective. Instead:

1. the SIGTERM handler only notes the signal (no communication inside a signal handler);
2. after each step every rank calls ``stop_after(step)``. The first rank that has seen the signal there
   proposes ``step + 1`` under the store key ``stop`` (first writer wins); every rank reads that key
   (one store round trip per step) and stops once it has finished that step.

Why ``step + 1`` is safe: each step's collectives need every rank, so while one rank is between step
s and s + 1, no rank can have finished step s + 1, and every rank reads the key after its step s + 1,
which is after the proposal. Every rank therefore stops after the same step, runs its teardown and
exits; none is left inside a collective.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from lightning_shardlab.guard.side_channel import SideChannel
from lightning_shardlab.guard.watchdog import log


class OrderlyStop:
    def __init__(self, channel: SideChannel) -> None:
        self.channel = channel
        self.signalled: str | None = None  # the signal this rank received
        self.agreed: dict | None = None  # {"step", "rank", "signal"} once any rank proposed a stop
        self._previous: Any = None

    @staticmethod
    def open(rank: int, world_size: int) -> OrderlyStop | None:
        channel = SideChannel.open("stop", rank, world_size)
        return None if channel is None else OrderlyStop(channel)

    def install(self) -> None:
        """Take over SIGTERM (main thread only; Lightning's own handler communicates inside the handler)."""
        if threading.current_thread() is threading.main_thread() and self._previous is None:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def uninstall(self) -> None:
        """Give SIGTERM back, unless another handler took it since (Lightning restores its own original at
        teardown, before callbacks tear down: putting back the handler seen at install would reinstate a
        finished Trainer's handler, and with it keep that Trainer and its model alive)."""
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signal.Signals(signum).name
        log(self.channel.rank, f"received {self.signalled}: every rank stops after the same step (the next one).")

    def stop_after(self, step: int) -> bool:
        """Call on every rank after each step: True on every rank after the same step once any rank got SIGTERM."""
        if self.agreed is None and self.signalled is not None:
            self.agreed = self.channel.first(
                "stop", {"step": step + 1, "rank": self.channel.rank, "signal": self.signalled}
            )
        elif self.agreed is None:
            self.agreed = self.channel.read("stop")
        return self.agreed is not None and step >= self.agreed["step"]

    def message(self) -> str:
        assert self.agreed is not None
        step, rank, signal = self.agreed["step"], self.agreed["rank"], self.agreed["signal"]
        return f"stopped in order after step {step}: rank {rank} received {signal}."
