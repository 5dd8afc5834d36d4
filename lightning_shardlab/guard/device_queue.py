"""The collectives the device has not finished: a hang on a GPU, seen without waiting on the host.

On NCCL a collective's ``wait()`` returns at once (the compute stream waits, not the host), so a collective that
never completes on the device leaves no rank blocked in one: the host runs ahead until it blocks somewhere else
(a read of a device value, a full queue), and ``Comm.waiting`` never says so. So the watchdog (watchdog.py)
keeps each collective launched on a GPU here, with its works, in launch order, and asks them whether they are
complete (``Work.is_completed``: an event query, never a wait). The oldest one still incomplete after
``collective_timeout_s`` is a hang, named like any other. Completed entries are let go at every launch and
every poll, so a collective's tensors are held no longer than the device needs them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from lightning_shardlab.comm.call import CollectiveCall


class DeviceQueue:
    """``launched`` from the main thread, ``stuck`` from the watchdog's."""

    def __init__(self) -> None:
        self._queue: deque[tuple[CollectiveCall, list[Any], float]] = deque()
        self._lock = threading.Lock()

    def launched(self, call: CollectiveCall, works: list[Any], now: float) -> None:
        with self._lock:
            self._drop_completed()
            if works:
                self._queue.append((call, works, now))

    def stuck(self, now: float, timeout_s: float) -> CollectiveCall | None:
        """The oldest collective not complete on the device ``timeout_s`` after its launch, or None."""
        with self._lock:
            self._drop_completed()
            if self._queue and now - self._queue[0][2] > timeout_s:
                return self._queue[0][0]
        return None

    def __len__(self) -> int:
        return len(self._queue)

    def _drop_completed(self) -> None:
        while self._queue and all(work.is_completed() for work in self._queue[0][1]):
            self._queue.popleft()
