"""The collectives, as free functions. The only module that moves parameters between ranks.

Each function takes the ``Comm`` it runs on, reports itself to ``comm.ledger`` (kind, label, bytes,
seconds waited) and, at world size 1, runs the same code path without communicating or copying.

Backends: gloo for CPU ranks and for ranks that share one GPU (NCCL refuses two ranks on one device),
NCCL for ranks that own a GPU. Where gloo is handed CUDA tensors, they are staged through CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardlab.comm.call import CollectiveCall, CollectiveObserver
from lightning_shardlab.comm.labels import phase
from lightning_shardlab.comm.ledger import Ledger
from lightning_shardlab.comm.step_clock import CallTimes, StepClock
from lightning_shardlab.comm.transport import Builtin, Launched, pairwise_all_to_all
from lightning_shardlab.comm.verify import HEADER, HeaderExchange, Headers
from lightning_shardlab.comm.wire import KEPT_AFTER_FAILURE, MIN_LIMIT, Wire


@dataclass
class Comm:
    """The process group this rank trains in, and who watches its traffic."""

    rank: int
    world_size: int
    device: torch.device
    group: Any = None  # None = the default (world) group
    ledger: Ledger = field(default_factory=Ledger)
    observers: list[CollectiveObserver] = field(default_factory=list)
    seq: int = 0
    # how all-gathers and reduce-scatters travel (comm/transport.py); choose_transports() may change them
    transports: dict[str, Any] = field(default_factory=lambda: {"all_gather": Builtin, "reduce_scatter": Builtin})
    transport_times: dict[str, Any] = field(default_factory=dict)  # what choose_transports measured
    # verified collectives (enable_verification): every call on the verified wire (gloo), preceded by a header
    # exchange (gloo, transport="builtin"), or with one beside it, checked at its wait (NCCL)
    wire: Wire | None = None
    header_exchange: HeaderExchange | None = None
    waiting: int = 0  # > 0 while this rank's main thread is blocked in one of these collectives (the watchdog reads it)
    # the groups of a mesh (comm/mesh.py): which kind of group this is, its members' global ranks in group-rank
    # order (None: the world), every group of its kind, and the world Comm it belongs to (None: it is the world)
    scope: str = "world"
    ranks: tuple[int, ...] | None = None
    partition: tuple[tuple[int, ...], ...] | None = None
    parent: Comm | None = None
    clock: StepClock | None = None  # where this rank's time goes (comm/step_clock.py), while someone measures it
    host: Comm | None = None  # NCCL: the same ranks on gloo, for host tensors (comm/host_side.py)
    side: str = ""  # "host" for such a twin: its calls are numbered apart from its group's

    @property
    def backend(self) -> str:
        if self.world_size == 1 or not dist.is_initialized():
            return "none"
        return dist.get_backend(self.group)

    @property
    def stages_through_cpu(self) -> bool:
        """gloo cannot reduce CUDA tensors: ranks sharing a GPU stage them through host memory."""
        return self.backend == "gloo" and self.device.type == "cuda"

    @property
    def host_side(self) -> Comm:
        """Where host tensors and objects travel without touching the device's queue (comm/host_side.py)."""
        return self.host or self

    @property
    def headers(self) -> Headers | None:
        """The fingerprint codec of the verified collectives, if they are on."""
        for way in (self.wire, self.header_exchange):
            if way is not None:
                return way.headers
        return None

    @staticmethod
    def single() -> Comm:
        return Comm(rank=0, world_size=1, device=torch.device("cpu"))

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark a stretch in which the calling thread waits for other ranks (a hang shows as ``waiting``)."""
        root = self.parent or self  # one counter per rank, whichever group it waits in
        root.waiting += 1
        try:
            yield
        finally:
            root.waiting -= 1

    @property
    def step_clock(self) -> StepClock | None:
        """The clock running on this rank, shared by every group of its mesh (None: nobody measures time)."""
        return (self.parent or self).clock

    @contextmanager
    def timed(self, kind: str, label: str) -> Iterator[None]:
        """A call this rank blocks on from start to end (the object collectives): blocked time on the clock."""
        clock = self.step_clock
        times = clock.arrive(kind, label, self.ranks) if clock is not None else None
        try:
            yield
        finally:
            if times is not None:
                clock.launched(times, [])
                times.completed = times.launched

    def global_rank(self, rank: int) -> int:
        """The world rank of this group's ``rank``."""
        return rank if self.ranks is None else self.ranks[rank]

    def start(
        self,
        kind: str,
        label: str,
        tensor: Tensor | None,
        sizes: tuple[int, int] | None = None,
        dtype: str | None = None,
    ) -> CollectiveCall:
        """A call is launched: it counts now, with the bytes of its full tensor (its seconds at ``finish``).
        ``sizes`` (an all-to-all, whose parts differ by rank; a packed call): (numel of the whole exchange, the
        same on every rank, for its fingerprint; bytes for the ledger). ``dtype``: what travels, where it is not
        the tensor's own (a packed call, comm/packing.py)."""
        numel = 0 if tensor is None else tensor.numel()
        nbytes = numel * (0 if tensor is None else tensor.element_size())
        if sizes is not None:
            numel, nbytes = sizes
        dtype = dtype or ("object" if tensor is None else str(tensor.dtype).removeprefix("torch."))
        self.ledger.record_launch(kind, label, nbytes, self.scope, dtype)
        call = CollectiveCall(self.seq, kind, label, numel, dtype, self.scope, self.side)
        self.seq += 1
        for observer in self.observers:
            observer.started(call)
        if self.header_exchange is not None and not self.header_exchange.deferred:
            with self.blocking():
                self.header_exchange.check(call, self.ledger, self.scope)
        elif self.wire is not None:  # the headers travel with the call: two messages per peer
            self.ledger.record_launch("verify", "", 2 * (self.world_size - 1) * HEADER * 8, self.scope)
        return call

    def finish(self, call: CollectiveCall, seconds: float) -> None:
        self.ledger.record_seconds(call.kind, call.label, seconds, self.scope)
        for observer in self.observers:
            observer.finished(call, seconds)


def enable_verification(comm: Comm, limit_bytes: int = MIN_LIMIT, builtin: bool = False) -> Headers | None:
    """From now on every call of ``comm`` is verified (comm/verify.py): on the verified wire on gloo, where every
    receive has room for ``limit_bytes`` (the largest payload a call may send: the same on every rank), by a
    header exchange before each call on gloo with ``builtin``, and beside each call on NCCL (on its gloo twin,
    checked when the call is waited for). Collective for the header exchange
    (every rank, same point). Nothing to verify at world size 1. Returns the fingerprint codec."""
    if comm.world_size > 1 and comm.headers is None:
        headers = Headers(comm.rank, comm.world_size, comm.ranks)
        if comm.backend == "gloo" and not builtin:
            comm.wire = Wire(comm.group, comm.rank, comm.world_size, headers, limit_bytes)
        elif comm.backend == "gloo":  # gloo aborts on a payload of another size: the headers agree first
            comm.header_exchange = HeaderExchange.open(headers, comm.partition)
        else:  # NCCL: beside each call on the gloo twin, checked when it is waited for
            twin = comm.host.group if comm.host is not None else None
            comm.header_exchange = HeaderExchange.open(headers, comm.partition, twin, deferred=True)
    return comm.headers


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and runs its finishing step.

    1. wait for its headers, if it is verified, and check them  2. wait for the rest  3. finish. Each work
    is waited for exactly once (gloo hangs on a second wait). The ledger is told the seconds this rank spent
    blocked on it (launching it, and in ``wait``): the communication that compute did not hide, not the
    time it was in flight."""

    def __init__(
        self,
        launched: Launched,
        record: Callable[[float], None],
        launch_seconds: float = 0.0,
        comm: Comm | None = None,
        times: CallTimes | None = None,
    ) -> None:
        self._launched, self._record, self._comm = launched, record, comm
        self._blocked = launch_seconds
        self._times = times  # its times on the step clock, if one runs (comm/step_clock.py)
        self._clock = comm.step_clock if times is not None else None
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True  # also when the check raises: its works are not waited for again
        started = time.perf_counter() if self._clock is None else self._clock.block(self._times)
        launched = self._launched
        with self._comm.blocking() if self._comm is not None else nullcontext():
            for work in launched.first:
                work.wait()
            if launched.check is not None:
                try:
                    launched.check()
                except Exception:
                    KEPT_AFTER_FAILURE.append(launched)  # its sends must still reach the peers (comm/wire.py)
                    raise
            for work in launched.works:
                work.wait()
        if launched.finish is not None:
            launched.finish()
        if self._clock is not None:
            self._clock.unblock(self._times, started)
        self._record(self._blocked + time.perf_counter() - started)


NOTHING = Pending(Launched([]), lambda seconds: None)  # what world size 1 returns: nothing to wait for


def _run(
    comm: Comm,
    kind: str,
    label: str,
    full: Tensor,
    launch: Callable[[CollectiveCall], Any],
    finish: Callable[[], None] | None,
    async_op: bool,
    sizes: tuple[int, int] | None = None,
    dtype: str | None = None,
) -> Pending:
    """Announce the call to the observers, launch it, and (unless async) wait for it.

    ``launch(call)`` returns a work or a ``Launched``; ``finish`` runs after the launched finishing step."""
    call = comm.start(kind, label, full, sizes, dtype)
    clock = comm.step_clock
    times = clock.arrive(kind, label, comm.ranks) if clock is not None else None
    with phase(kind, label):
        started = time.perf_counter()
        headers = _launch_headers(comm, call)
        with comm.blocking():  # a payload larger than the wire's room waits for the headers here
            launched = launch(call)
        if not isinstance(launched, Launched):
            launched = Launched([launched])
        if headers is not None:  # NCCL: checked when the call is waited for, before its data is used
            launched.first.insert(0, headers[0])
            launched.check = headers[1] if launched.check is None else _both(headers[1], launched.check)
        if finish is not None:
            first = launched.finish
            launched.finish = finish if first is None else lambda: (first(), finish())
        seconds = time.perf_counter() - started
        for observer in comm.observers:
            observer.launched(call, [*launched.first, *launched.works])
        if times is not None:
            clock.launched(times, [*launched.first, *launched.works])
        pending = Pending(launched, lambda seconds: comm.finish(call, seconds), seconds, comm, times)
    if not async_op:
        pending.wait()
    return pending


def _launch_headers(comm: Comm, call: CollectiveCall) -> tuple[Any, Callable[[], None]] | None:
    """A deferred header exchange (NCCL, comm/verify.py): launched beside the call, (its work, its check)."""
    exchange = comm.header_exchange
    if exchange is None or not exchange.deferred:
        return None
    return exchange.launch(call, comm.ledger, comm.scope)


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    return lambda: (first(), second())


def _staged(tensor: Tensor, comm: Comm) -> Tensor:
    return tensor.cpu() if comm.stages_through_cpu else tensor


def all_gather(
    full: Tensor, shard: Tensor, comm: Comm, label: str = "", async_op: bool = False, kind: str = "all_gather"
) -> Pending:
    """shards -> whole: ``full`` (1-D, world_size * S) receives every rank's ``shard`` (1-D, S) in rank order.

    ``kind`` names what the ledger files it under (bookkeeping traffic is kept apart from parameters')."""
    if comm.world_size == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return NOTHING
    out, inp = _staged(full, comm), _staged(shard, comm)
    finish = (lambda: full.copy_(out)) if out is not full else None
    if comm.wire is not None:
        return _run(comm, kind, label, full, lambda call: comm.wire.all_gather(call, out, inp), finish, async_op)
    transport = comm.transports["all_gather"]
    return _run(
        comm,
        kind,
        label,
        full,
        lambda call: transport.all_gather(out, inp, comm.group, comm.rank, comm.world_size),
        finish,
        async_op,
    )


def reduce_scatter(shard: Tensor, full: Tensor, comm: Comm, label: str = "", async_op: bool = False) -> Pending:
    """whole gradients -> averaged shards: ``shard`` (1-D, S) = mean over ranks of ``full[rank*S:(rank+1)*S]``."""
    if comm.world_size == 1:
        if full.data_ptr() != shard.data_ptr():
            shard.copy_(full)
        return NOTHING
    out, inp = _staged(shard, comm), _staged(full, comm)
    world = comm.world_size

    def finish() -> None:
        # Sum, then divide once on the (smaller) output: the same average DDP computes.
        out.div_(world)
        if out is not shard:
            shard.copy_(out)

    if comm.wire is not None:
        launch = lambda call: comm.wire.reduce_scatter_sum(call, out, inp)  # noqa: E731
    else:
        transport = comm.transports["reduce_scatter"]
        launch = lambda call: transport.reduce_scatter_sum(out, inp, comm.group, comm.rank, world)  # noqa: E731
    return _run(comm, "reduce_scatter", label, full, launch, finish, async_op)


def all_to_all(sends: list[Tensor], recvs: list[Tensor], comm: Comm, numel: int, label: str = "") -> None:
    """parts -> their ranks: ``recvs[p]`` (1-D, the size rank p sends here) receives rank p's ``sends[rank]``
    (1-D, one dtype); ``sends[rank]`` is copied into ``recvs[rank]``. ``numel``: the elements the whole exchange
    moves between all pairs (the same on every rank). The ledger counts the bytes this rank sends."""
    me = comm.rank
    if recvs[me].numel():
        recvs[me].copy_(sends[me])
    if comm.world_size == 1:
        return
    nbytes = sum(t.numel() * t.element_size() for p, t in enumerate(sends) if p != me)
    outs = [_staged(t, comm) for t in recvs]
    ins = [_staged(t, comm) for t in sends]

    def finish() -> None:
        for out, recv in zip(outs, recvs):
            if out is not recv:
                recv.copy_(out)

    if comm.wire is not None:
        launch = lambda call: comm.wire.all_to_all(call, outs, ins)  # noqa: E731
    else:
        launch = lambda call: pairwise_all_to_all(outs, ins, comm.group, me, comm.world_size)  # noqa: E731
    _run(comm, "all_to_all", label, sends[me], launch, finish, async_op=False, sizes=(numel, nbytes))


def all_reduce(tensor: Tensor, comm: Comm, op: str = "sum", label: str = "") -> Tensor:
    """In place: ``tensor`` becomes the sum (or max / min) over ranks. Returns ``tensor``."""
    launch_all_reduce(tensor, comm, op, label).wait()
    return tensor


def launch_all_reduce(tensor: Tensor, comm: Comm, op: str = "sum", label: str = "") -> Pending:
    """``all_reduce``, in flight: ``tensor`` holds the result once the returned ``Pending`` is waited for."""
    if comm.world_size == 1:
        return NOTHING
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    buf = _staged(tensor, comm)
    finish = (lambda: tensor.copy_(buf)) if buf is not tensor else None
    if comm.wire is not None:
        launch = lambda call: comm.wire.all_reduce(call, buf, op)  # noqa: E731
    else:
        launch = lambda call: dist.all_reduce(buf, op=ops[op], group=comm.group, async_op=True)  # noqa: E731
    return _run(comm, "all_reduce", label, tensor, launch, finish, async_op=True)


def broadcast(tensor: Tensor, comm: Comm, src: int = 0, label: str = "") -> Tensor:
    """In place: every rank's ``tensor`` becomes rank ``src``'s."""
    if comm.world_size == 1:
        return tensor
    buf = _staged(tensor, comm)
    finish = (lambda: tensor.copy_(buf)) if buf is not tensor else None
    if comm.wire is not None:
        launch = lambda call: comm.wire.broadcast(call, buf, src)  # noqa: E731
    else:
        launch = lambda call: dist.broadcast(buf, src=src, group=comm.group, async_op=True)  # noqa: E731
    _run(comm, "broadcast", label, tensor, launch, finish, async_op=False)
    return tensor


def all_gather_object(obj: Any, comm: Comm, label: str = "", kind: str = "all_gather_object") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (``kind``: what the ledger files it under)."""
    if comm.world_size == 1:
        return [obj]
    comm = comm.host_side
    call = comm.start(kind, label, None)
    started = time.perf_counter()
    with comm.blocking(), comm.timed(kind, label):
        if comm.wire is not None:
            out = comm.wire.all_gather_object(call, obj)
        else:
            out = [None] * comm.world_size
            dist.all_gather_object(out, obj, group=comm.group)
    comm.finish(call, time.perf_counter() - started)
    return out


def barrier(comm: Comm, label: str = "") -> None:
    if comm.world_size > 1:
        comm = comm.host_side
        call = comm.start("barrier", label, None)
        started = time.perf_counter()
        with comm.blocking(), comm.timed("barrier", label):
            if comm.wire is not None:
                comm.wire.barrier(call)
            else:
                dist.barrier(group=comm.group)
        comm.finish(call, time.perf_counter() - started)


def broadcast_object(obj: Any, comm: Comm, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    if comm.world_size == 1:
        return obj
    comm = comm.host_side
    call = comm.start("broadcast_object", "", None)
    started = time.perf_counter()
    with comm.blocking(), comm.timed("broadcast_object", ""):
        if comm.wire is not None:
            obj = comm.wire.broadcast_object(call, obj, src)
        else:
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=comm.group)
            obj = box[0]
    comm.finish(call, time.perf_counter() - started)
    return obj
