"""The watchdog: no endless hang, and no rank left waiting for one that is gone.

Per rank, a daemon thread publishes a heartbeat with what this rank is doing (the collective in flight,
the last one finished, where its main thread is) through the rendezvous store (guard/side_channel.py: the
store keeps answering while the backend waits) and watches for three faults:

    hang      this rank's main thread has been blocked in a collective for ``timeout_s`` with no collective
              started or finished meanwhile (blocked: the collectives count themselves in ``Comm.waiting``
              while they wait; so an async collective launched early and waited late is no hang); on a GPU
              also a collective the device has not completed ``timeout_s`` after its launch (device_queue.py:
              NCCL's wait returns at once, so the host does not wait in it)
    failure   a rank reported an exception (``handle_exception``: from on_exception, or the guard)
    death     rank 0 watches the others: a process on its host that is gone, or a rank on another host
              whose heartbeat stopped for ``heartbeat_timeout_s``; every rank notices a store that is
              gone (its host, rank 0 under ``env://``, has ended)

Ending the run: the first rank to see a fault posts a report under ``abort`` (first writer wins, so every
rank prints the same cause) and waits up to ``ack_s`` for the others to acknowledge it, so that a store
host does not exit before they have read it. Every rank then logs the report (each line ``[rank r]``) and
stops its main thread: the next collective it announces raises ``RankFailure`` (``started``), a signal
(SIGUSR2) raises it in Python code that runs no collective, and a rank stuck inside the backend is ended
with ``os._exit(1)`` after ``grace_s``.

Bounds, from the fault to every rank having ended:
    hang      timeout_s + poll_s + ack_s + grace_s                 (defaults: 300 + 1 + 5 + 10 s)
    failure   poll_s + ack_s + grace_s                              (16 s; ranks blocked in the backend
              usually leave at once, when the failed rank's exit closes their connections)
    death     poll_s (same host; heartbeat_timeout_s on another host) + ack_s + grace_s
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist

from lightning_shardlab.comm.call import CollectiveCall, CollectiveObserver
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.mismatch import SanityError
from lightning_shardlab.guard import report
from lightning_shardlab.guard.device_queue import DeviceQueue
from lightning_shardlab.guard.side_channel import SideChannel, first, process_gone, put, read, this_process

_COMM_ERRORS = (
    "Connection closed by peer",
    "Connection reset",
    "Broken pipe",
    "NCCL",
    "Socket Timeout",
    "DistNetworkError",
    "DistBackendError",
    "DistStoreError",
    "Timed out",
    "timed out",
)


class RankFailure(RuntimeError):
    """Another rank failed, died or hung, so this rank ends too. The message is the watchdog's report."""


def log(rank: int, text: str) -> None:
    """Every line of ``text`` to stderr, prefixed ``[rank r]``."""
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()


class Watchdog(CollectiveObserver):
    """One rank's watchdog: ``start()`` it on every rank before training, ``stop()`` it after a clean end,
    and hand it any exception that ends training (``handle_exception``). The observer events give it the
    collectives in flight; the thread does the rest."""

    def __init__(
        self,
        comm: Comm,
        timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 30.0,
        poll_s: float = 1.0,
        grace_s: float = 10.0,
        ack_s: float = 5.0,
    ) -> None:
        self.comm = comm
        self.timeout_s, self.heartbeat_timeout_s, self.poll_s = timeout_s, heartbeat_timeout_s, poll_s
        self.grace_s, self.ack_s = grace_s, ack_s
        self.report: str | None = None  # the abort report, once this rank knows it
        self.channel: SideChannel | None = None
        # (scope, side, seq) -> (call, started at): each group of a mesh, and its host twin, numbers its own calls
        self._inflight: dict[tuple[str, int], tuple[CollectiveCall, float]] = {}
        # on a GPU: the collectives the device has not finished (device_queue.py: a hang the host does not wait in)
        self.device = DeviceQueue() if comm.device.type == "cuda" else None
        self._last: tuple[CollectiveCall | None, float] = (None, time.monotonic())  # last finished, when
        self._blocked_since: float | None = None  # the main thread seen blocked in a collective, no progress since
        self._progress: tuple = ()  # (collectives issued, last finished) when it was last sampled
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank 0: rank -> (its last beat, when it changed)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._main_knows = threading.Event()  # the main thread is handling the end: no signal needed
        self._thread: threading.Thread | None = None
        self._previous_handler: Any = None

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._closed.is_set()

    @property
    def thread_alive(self) -> bool:
        """The thread still runs (before ``close``, or when its join timed out)."""
        return self._thread is not None and self._thread.is_alive()

    # ---- life cycle (main thread) ----

    def start(self) -> Watchdog:
        """Publish the first heartbeat, watch this rank's collectives, start the thread. No-op at world size 1."""
        self.channel = SideChannel.open("watchdog", self.comm.rank, self.comm.world_size)
        if self.channel is None:
            return self
        self._publish(self.channel.store, "running")
        self.comm.observers.insert(0, self)
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR2, self._raise_in_main)
        self._thread = threading.Thread(
            target=self._watch,
            args=(self.channel.connection(),),
            name=f"shardlab-watchdog-{self.comm.rank}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """A clean end: say so, and (rank 0) keep the store up until every rank has stopped watching."""
        if not self.active:
            return
        self.close()
        assert self.channel is not None
        self._publish(self.channel.store, "stopped")
        self.channel.store.add("stopped", 1)
        deadline = time.monotonic() + self.heartbeat_timeout_s
        while self.comm.rank == 0 and time.monotonic() < deadline:
            if int(self.channel.store.add("stopped", 0)) >= self.comm.world_size:
                break
            time.sleep(0.01)

    def close(self) -> None:
        """Stop watching (any end): the thread leaves, observers and signal handler are restored."""
        if self._thread is None or self._closed.is_set():
            return
        self._closed.set()
        if self in self.comm.observers:
            self.comm.observers.remove(self)
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR2, self._previous_handler)
            self._previous_handler = None
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.poll_s + 5.0)

    # ---- what the main thread's collectives tell it ----

    def started(self, call: CollectiveCall) -> None:
        if self.report is not None:
            self._main_knows.set()
            raise RankFailure(self.report)
        self._inflight[(call.scope, call.side, call.seq)] = (call, time.monotonic())

    def launched(self, call: CollectiveCall, works: list) -> None:
        if self.device is not None:
            self.device.launched(call, works, time.monotonic())

    def finished(self, call: CollectiveCall, seconds: float) -> None:
        self._inflight.pop((call.scope, call.side, call.seq), None)
        self._last = (call, time.monotonic())

    def handle_exception(self, exc: BaseException) -> str | None:
        """Main thread, on an exception leaving the training loop. Reports it as the cause unless another
        rank's end caused it; returns that other rank's report (to attach to ``exc``), else None."""
        self._main_knows.set()
        if not self.active or isinstance(exc, RankFailure):
            self.close()
            return None
        assert self.channel is not None
        if isinstance(exc, SanityError):  # raised on every rank at the same point: nobody is left waiting
            self._publish(self.channel.store, "failed", error=report.error_line(exc))
            self.close()
            return None
        if self.report is None and any(s in f"{type(exc).__name__}: {exc}" for s in _COMM_ERRORS):
            self._await_report(self.channel.store, self.heartbeat_timeout_s + 2 * self.poll_s)
        caused_elsewhere = self.report is not None
        if not caused_elsewhere:
            try:
                self._publish(self.channel.store, "failed", error=report.error_line(exc))
                self._abort(self.channel.store, report.failure(self.comm.rank, exc, self._states(self.channel.store)))
            except (dist.DistError, OSError) as store_error:  # the store may be gone too; the error itself stands
                log(self.comm.rank, f"could not tell the other ranks through the store: {store_error}")
        self.close()
        return self.report if caused_elsewhere else None

    # ---- the thread ----

    def _watch(self, store: Any) -> None:
        while not self._closed.wait(self.poll_s):
            try:
                self._check(store)
            except (dist.DistError, OSError) as error:  # a store that stopped answering is itself the news
                if not self._closed.is_set():
                    self._store_lost(error)
                return

    def _check(self, store: Any) -> None:
        self._publish(store, "running")
        abort = read(store, "abort")
        if abort is not None and self.report is None:
            return self._end(store, abort, origin=False)
        if self.report is not None:
            return  # this rank is ending already
        if self._blocked_since is not None and time.monotonic() - self._blocked_since > self.timeout_s:
            oldest = self._oldest()
            call = None if oldest is None else oldest[0].fingerprint
            return self._abort(store, report.hang(self.comm.rank, call, self.timeout_s, self._states(store)))
        stuck = self.device.stuck(time.monotonic(), self.timeout_s) if self.device is not None else None
        if stuck is not None:  # incomplete on the device: the host ran on (NCCL's wait returns at once)
            return self._abort(
                store, report.hang(self.comm.rank, stuck.fingerprint, self.timeout_s, self._states(store))
            )
        gone = self._gone(store) if self.comm.rank == 0 else {}
        if gone:
            self._abort(store, report.death(gone, self._states(store)), dead=set(gone))

    def _abort(self, store: Any, text: str, dead: set[int] = frozenset()) -> None:
        """Post the report unless another rank already did; end with whichever is there."""
        winner = first(store, "abort", {"rank": self.comm.rank, "report": text, "dead": sorted(dead)})
        self._end(store, winner, origin=winner["rank"] == self.comm.rank)

    def _learn(self, store: Any, abort: dict) -> None:
        """Take ``abort``'s report as this rank's (once: both threads may find it), log it, acknowledge it."""
        with self._lock:
            if self.report is not None:
                return
            self.report = abort["report"]
        log(self.comm.rank, self.report)
        store.set(f"ack/{self.comm.rank}", "")

    def _end(self, store: Any, abort: dict, origin: bool) -> None:
        """Learn the report; the rank that posted it waits (up to ack_s) for every live rank's
        acknowledgement, so that it (the store's host, perhaps) does not leave before they read it."""
        self._learn(store, abort)
        live = [f"ack/{r}" for r in range(self.comm.world_size) if r not in abort.get("dead", ())]
        deadline = time.monotonic() + self.ack_s
        while origin and not store.check(live) and time.monotonic() < deadline:
            time.sleep(0.01)
        if threading.current_thread() is self._thread:
            self._stop_main()

    def _stop_main(self) -> None:
        """Stop the main thread: a signal for Python code; ``os._exit`` for a rank stuck in the backend."""
        if not self._main_knows.is_set() and self._previous_handler is not None:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        if not self._closed.wait(self.grace_s):
            log(
                self.comm.rank,
                f"the main thread did not leave within grace_s={self.grace_s:g} s (stuck in a"
                " collective): ending the process.",
            )
            os._exit(1)

    def _raise_in_main(self, signum: int, frame: Any) -> None:
        if not self._main_knows.is_set() and self.report is not None:
            self._main_knows.set()
            raise RankFailure(self.report)

    def _store_lost(self, error: Exception) -> None:
        self.report = report.store_lost(self.comm.rank, error)
        log(self.comm.rank, self.report)
        self._stop_main()

    # ---- heartbeats and the other ranks' states ----

    def _sample(self) -> tuple[bool, str | None]:
        """Where the main thread is, and whether it is blocked in a collective; keeps ``_blocked_since``."""
        blocked, where = self.comm.waiting > 0, sample_main_thread()  # the collectives say when they wait
        last = self._last[0]
        progress = (self.comm.seq, None if last is None else (last.scope, last.side, last.seq))
        if not blocked or progress != self._progress:
            self._blocked_since = time.monotonic() if blocked else None
        self._progress = progress
        return blocked, where

    def _publish(self, store: Any, state: str, **extra: Any) -> None:
        self._beat += 1
        blocked, where = self._sample()
        inflight = self._oldest()
        last, last_at = self._last
        now = time.monotonic()
        status = {
            "rank": self.comm.rank,
            "beat": self._beat,
            "state": state,
            "issued": self.comm.seq,
            **this_process(),
            "blocked": blocked,
            "waiting_s": None if self._blocked_since is None else now - self._blocked_since,
            "inflight": None if inflight is None else list(inflight[0].fingerprint),
            "last": None if last is None else list(last.fingerprint),
            "idle_s": now - last_at,
            "where": where,
            **extra,
        }
        put(store, f"status/{self.comm.rank}", status)

    def _oldest(self) -> tuple[CollectiveCall, float] | None:
        """This rank's oldest collective in flight (the main thread adds and removes them: copy first)."""
        return min(list(self._inflight.values()), key=lambda entry: entry[1], default=None)

    def _states(self, store: Any) -> dict[int, dict | None]:
        return {r: read(store, f"status/{r}") for r in range(self.comm.world_size)}

    def _gone(self, store: Any) -> dict[int, str]:
        """Rank 0: ranks whose process has ended or whose heartbeat stopped, with why we think so."""
        gone, now = {}, time.monotonic()
        for rank, status in self._states(store).items():
            if rank == self.comm.rank or status is None or status["state"] != "running":
                continue
            if process_gone(status):
                gone[rank] = f"its process {status['pid']} on {status['host']} has ended (killed?)"
                continue
            beat, since = self._seen.get(rank, (None, now))
            if status["beat"] != beat:
                self._seen[rank] = (status["beat"], now)
            elif now - since > self.heartbeat_timeout_s:
                gone[rank] = f"no heartbeat for {now - since:.0f} s (heartbeat_timeout_s={self.heartbeat_timeout_s:g})"
        return gone

    def _await_report(self, store: Any, seconds: float) -> None:
        """Main thread: wait for another rank's (or this rank's thread's) report of the cause."""
        deadline = time.monotonic() + seconds
        while self.report is None and time.monotonic() < deadline:
            try:
                abort = read(store, "abort")
            except (dist.DistError, OSError) as error:
                self.report = report.store_lost(self.comm.rank, error)
                log(self.comm.rank, self.report)
                return
            if abort is not None:
                self._learn(store, abort)
                return
            time.sleep(0.05)


def sample_main_thread() -> str | None:
    """``path:line in function`` of the main thread's innermost frame in user code (outside torch, Lightning
    and this package): where a hang report says a rank is."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return None
    frames = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_shardlab/, all of it
    user = [
        f
        for f in frames
        if "site-packages" not in f.filename and not f.filename.startswith(package) and "/lib/python" not in f.filename
    ]
    f = (user or list(frames) or [None])[0]
    return None if f is None else f"{f.filename}:{f.lineno} in {f.name}"
