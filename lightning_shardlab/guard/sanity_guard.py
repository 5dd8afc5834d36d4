"""``SanityGuard``: the sanity checks wired together for one sharded model (the pieces: __init__.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.core.config import check_bool, check_int, check_positive
from lightning_shardlab.guard.data_source import describe
from lightning_shardlab.guard.device_check import DeviceCheck
from lightning_shardlab.guard.duplicate_data import DataVerdicts
from lightning_shardlab.guard.fingerprints import FingerprintRecorder, StrictCollectives, check_fingerprints
from lightning_shardlab.guard.orderly_stop import OrderlyStop
from lightning_shardlab.guard.watchdog import Watchdog, log
from lightning_shardlab.sharding.sharded_model import ShardedModel


@dataclass(frozen=True)
class SanityConfig:
    every_n_steps: int = 10
    """Run the cheap checks (collective fingerprints, replicated state, data) before every K-th step; 0: never.
    Each is one tiny all-gather; a fault is reported within K steps."""

    strict_collectives: bool = False
    """Debug mode: compare every collective's fingerprint across ranks (through the store) before it runs."""

    verify_collectives: bool = True
    """Every collective carries its fingerprint in a header, checked on every rank before its payload is used
    (comm/verify.py, comm/wire.py): ranks that part raise a named error at that collective, not a hang or
    gloo's abort."""

    check_replicated: bool = True
    """Compare buffers, stage 1-2 full parameters and optimizer hyperparameters/step counters across ranks."""

    check_data: bool = True
    """Report ranks that draw the same samples: equal batches judged by the ranks' samplers (a DistributedSampler's
    indices), so equal samples drawn by other indices are no fault; equal batches it cannot judge (an
    IterableDataset) are warned of once."""

    skip_buffers: tuple[str, ...] = ()
    """fnmatch patterns of buffers that legitimately differ across ranks (normalisation statistics are skipped
    already)."""

    collective_timeout_s: float | None = 300.0
    """End the run on every rank, with a report, when a collective has not finished after this long; None: no
    watchdog."""

    heartbeat_timeout_s: float = 30.0
    """A rank on another host whose heartbeat stopped this long is reported dead (same host: its pid tells at once)."""

    poll_s: float = 1.0
    """How often the watchdog publishes a heartbeat and looks for faults."""

    grace_s: float = 10.0
    """After a fault, how long a rank may take to leave by itself before it is ended with os._exit."""

    handle_sigterm: bool = True
    """On SIGTERM (any rank), stop every rank after the same step."""

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, 0, " (0: never)")
        for option in ("strict_collectives", "verify_collectives", "check_replicated", "check_data", "handle_sigterm"):
            check_bool(option, getattr(self, option))
        for option in ("collective_timeout_s", "heartbeat_timeout_s", "poll_s", "grace_s"):
            value = getattr(self, option)
            if value is not None or option != "collective_timeout_s":
                check_positive(option, value, "a positive number of seconds")
        if isinstance(self.skip_buffers, str) or not all(isinstance(p, str) for p in self.skip_buffers):
            raise ValueError(f"`skip_buffers={self.skip_buffers!r}` is invalid: expected a list of name patterns.")
        object.__setattr__(self, "skip_buffers", tuple(self.skip_buffers))


class SanityGuard:
    """Every sanity check for one sharded model (``shard_model``'s result) and its optimizers."""

    def __init__(
        self, sharded: ShardedModel, optimizers: list[Optimizer] = (), config: SanityConfig | None = None
    ) -> None:
        self.sharded, self.optimizers = sharded, list(optimizers)
        self.config = config or SanityConfig()
        self.recorder = FingerprintRecorder()
        self.strict: StrictCollectives | None = None
        self.watchdog: Watchdog | None = None
        self.orderly: OrderlyStop | None = None
        self._stragglers_warned = 0  # how many of the step clock's stragglers were warned of
        self._pending: DeviceCheck | None = None  # a check whose verdict waits for the device (device_check.py)
        self.data_verdicts = DataVerdicts()  # the data check's memory over the run: it warns once (duplicate_data.py)

    @property
    def comm(self) -> Comm:
        return self.sharded.comm

    def start(self) -> SanityGuard:
        """Collective in spirit: every rank starts its guard at the same point (before the first step)."""
        c, comm = self.config, self.comm
        if c.verify_collectives:
            self.sharded.verify_collectives()
        comm.observers.append(self.recorder)
        if c.strict_collectives:
            self.strict = StrictCollectives.open(comm, c.collective_timeout_s or 300.0)
            if self.strict is not None:
                comm.observers.append(self.strict)
        if c.collective_timeout_s is not None:
            self.watchdog = Watchdog(comm, c.collective_timeout_s, c.heartbeat_timeout_s, c.poll_s, c.grace_s).start()
        if c.handle_sigterm:
            self.orderly = OrderlyStop.open(comm.rank, comm.world_size)
        return self

    def install_sigterm(self) -> None:
        if self.orderly is not None:
            self.orderly.install()

    def before_step(self, step: int, batch: Any = None, loader: Any = None) -> None:
        """Every rank, before each step: the verdict of a check still in flight (a GPU's: device_check.py), then
        the cheap checks when ``step`` is a multiple of ``every_n_steps``. ``loader``: the DataLoader(s) ``batch``
        came from, whose sampler tells the data check which samples each rank drew (data_source.py); without it
        the check has the batch's bytes only, and equal bytes are taken for the same samples."""
        self.conclude()
        every = self.config.every_n_steps
        if every and step % every == 0:
            self.check(f"before step {step}", batch, loader)
        self.warn_of_stragglers()

    def conclude(self) -> None:
        """Collective on a fault: the verdict of the device check in flight, if any (raises on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.conclude()

    def warn_of_stragglers(self) -> None:
        """Warn once of each rank the step clock named persistently slower (budget/measured/stragglers.py, while
        ShardLabBudget measures time; every rank names the same ones, rank 0 says so)."""
        clock = self.comm.step_clock
        named = clock.stragglers if clock is not None else []
        for straggler in named[self._stragglers_warned :]:
            if self.comm.rank == 0:
                warnings.warn(f"[rank 0] straggler: {straggler['message']}", stacklevel=2)
        self._stragglers_warned = len(named)

    def check(self, when: str, batch: Any = None, loader: Any = None) -> None:
        """Collective: fingerprints, then replicated state and data (one all-gather of digests, judged now on
        CPU ranks, at the next step's start on a GPU). Raises on every rank on a fault."""
        check_fingerprints(self.comm, self.recorder, when)
        optimizers = self.optimizers if self.config.check_replicated else None
        batch = batch if self.config.check_data else None
        source = (describe(loader), self.data_verdicts)
        self._pending = DeviceCheck.launch(self.sharded, optimizers, self.config.skip_buffers, batch, when, source)
        if self._pending is not None and not self._pending.deferred:
            self.conclude()

    def stop_after(self, step: int) -> bool:
        """Every rank, after each step: True on every rank after the same step once any rank got SIGTERM."""
        if self.orderly is None or not self.orderly.stop_after(step):
            return False
        log(self.comm.rank, self.orderly.message())
        return True

    def finish(self) -> None:
        """A clean end (collective): the verdict of a check in flight and a last fingerprint check, then stop
        watching."""
        self.conclude()
        if self.config.every_n_steps:
            check_fingerprints(self.comm, self.recorder, "at the end")
        if self.watchdog is not None:
            self.watchdog.stop()
        self.close()

    def handle_exception(self, exc: BaseException) -> None:
        """On an exception: report it to the other ranks, or attach the report of the rank that caused it.
        An orderly stop (``SIGTERMException``, raised on every rank after the same step) just ends the checks."""
        if self.watchdog is not None and not isinstance(exc, SIGTERMException):
            note = self.watchdog.handle_exception(exc)
            if note is not None:
                exc.add_note(note)  # the traceback of this rank's own error ends with the cause
        self.close()

    def close(self) -> None:
        """Stop every check (idempotent)."""
        self._pending = None  # a check in flight when the run failed is not judged
        for observer in (self.recorder, self.strict):
            if observer is not None and observer in self.comm.observers:
                self.comm.observers.remove(observer)
        if self.watchdog is not None:
            self.watchdog.close()
        if self.orderly is not None:
            self.orderly.uninstall()
        for part in (self.watchdog, self.orderly, self.strict):
            if part is not None and part.channel is not None:
                # the store connections are free now, for the next checks (a watchdog thread still running
                # after its join keeps its own)
                part.channel.close(reuse=not (part is self.watchdog and self.watchdog.thread_alive))
        if self.strict is not None:
            self.strict.store = None  # type: ignore[assignment]

    def __enter__(self) -> SanityGuard:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.finish()
        else:
            self.handle_exception(exc)
