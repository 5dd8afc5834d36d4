"""The collectives, as free functions. The only module that moves parameters between ranks.

Each function takes the ``Comm`` it runs on, reports itself to ``comm.ledger`` (kind, label, bytes,
seconds waited) and, at world size 1, runs the same code path without communicating or copying.

Backends: gloo for CPU ranks and for ranks that share one GPU (NCCL refuses two ranks on one device),
NCCL for ranks that own a GPU. Where gloo is handed CUDA tensors, they are staged through CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardlab.labels import phase
from lightning_shardlab.ledger import Ledger
from lightning_shardlab.transport import TRANSPORTS, Builtin, time_transports


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as every rank must issue it: the same sequence of these on every rank."""

    seq: int  # this rank's count of collectives issued on its Comm
    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_gather_object, ...
    label: str  # what it moves, e.g. the flat parameter "blocks.3[float32]"
    numel: int  # elements of the full (gathered / reduced) tensor; 0 for objects
    dtype: str

    @property
    def fingerprint(self) -> tuple:
        return (self.seq, self.kind, self.label, self.numel, self.dtype)


class CollectiveObserver:
    """Sees every collective of a Comm: ``started`` before it is launched (it may raise to stop it),
    ``finished`` once it has been waited for."""

    def started(self, call: CollectiveCall) -> None:
        pass

    def finished(self, call: CollectiveCall, seconds: float) -> None:
        pass


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
    # how all-gathers and reduce-scatters travel (transport.py); choose_transports() may change them
    transports: dict[str, Any] = field(default_factory=lambda: {"all_gather": Builtin, "reduce_scatter": Builtin})
    transport_times: dict[str, Any] = field(default_factory=dict)  # what choose_transports measured

    @property
    def backend(self) -> str:
        if self.world_size == 1 or not dist.is_initialized():
            return "none"
        return dist.get_backend(self.group)

    @property
    def stages_through_cpu(self) -> bool:
        """gloo cannot reduce CUDA tensors: ranks sharing a GPU stage them through host memory."""
        return self.backend == "gloo" and self.device.type == "cuda"

    @staticmethod
    def single() -> Comm:
        return Comm(rank=0, world_size=1, device=torch.device("cpu"))

    def start(self, kind: str, label: str, tensor: Tensor | None) -> CollectiveCall:
        """A call is launched: it counts now, with the bytes of its full tensor (its seconds at ``finish``)."""
        self.ledger.record_launch(kind, label, 0 if tensor is None else tensor.numel() * tensor.element_size())
        call = CollectiveCall(self.seq, kind, label, 0 if tensor is None else tensor.numel(),
                              "object" if tensor is None else str(tensor.dtype).removeprefix("torch."))
        self.seq += 1
        for observer in self.observers:
            observer.started(call)
        return call

    def finish(self, call: CollectiveCall, seconds: float) -> None:
        self.ledger.record_seconds(call.kind, call.label, seconds)
        for observer in self.observers:
            observer.finished(call, seconds)


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and runs its finishing step.

    The ledger is told the seconds this rank spent blocked on it (launching it, and in ``wait``): the
    communication that compute did not hide, not the time it was in flight."""

    def __init__(self, works: list[Any], finish: Callable[[], None] | None, record: Callable[[float], None],
                 launch_seconds: float = 0.0) -> None:
        self._works, self._finish, self._record = works, finish, record
        self._blocked = launch_seconds
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        started = time.perf_counter()
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
        self.done = True
        self._record(self._blocked + time.perf_counter() - started)


NOTHING = Pending([], None, lambda seconds: None)  # what world size 1 returns: nothing to wait for


def _run(
    comm: Comm, kind: str, label: str, full: Tensor, launch: Callable[[], Any], finish: Callable[[], None] | None,
    async_op: bool,
) -> Pending:
    """Announce the call to the observers, launch it, and (unless async) wait for it.

    ``launch`` returns a work, or ``(works, finish)`` from a transport; ``finish`` runs after them."""
    call = comm.start(kind, label, full)
    with phase(kind, label):
        started = time.perf_counter()
        launched = launch()
        works, first = launched if isinstance(launched, tuple) else ([launched], None)
        steps = [f for f in (first, finish) if f is not None]
        pending = Pending(works, (lambda: [f() for f in steps]) if steps else None,
                          lambda seconds: comm.finish(call, seconds), time.perf_counter() - started)
    if not async_op:
        pending.wait()
    return pending


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
    transport = comm.transports["all_gather"]
    return _run(
        comm, kind, label, full, lambda: transport.all_gather(out, inp, comm.group, comm.rank, comm.world_size),
        finish, async_op,
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

    transport = comm.transports["reduce_scatter"]
    return _run(
        comm, "reduce_scatter", label, full,
        lambda: transport.reduce_scatter_sum(out, inp, comm.group, comm.rank, comm.world_size), finish, async_op,
    )


def all_reduce(tensor: Tensor, comm: Comm, op: str = "sum", label: str = "") -> Tensor:
    """In place: ``tensor`` becomes the sum (or max / min) over ranks. Returns ``tensor``."""
    if comm.world_size == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    buf = _staged(tensor, comm)
    finish = (lambda: tensor.copy_(buf)) if buf is not tensor else None
    _run(
        comm, "all_reduce", label, tensor,
        lambda: dist.all_reduce(buf, op=ops[op], group=comm.group, async_op=True), finish, async_op=False,
    )
    return tensor


def broadcast(tensor: Tensor, comm: Comm, src: int = 0, label: str = "") -> Tensor:
    """In place: every rank's ``tensor`` becomes rank ``src``'s."""
    if comm.world_size == 1:
        return tensor
    buf = _staged(tensor, comm)
    finish = (lambda: tensor.copy_(buf)) if buf is not tensor else None
    _run(
        comm, "broadcast", label, tensor,
        lambda: dist.broadcast(buf, src=src, group=comm.group, async_op=True), finish, async_op=False,
    )
    return tensor


def all_gather_object(obj: Any, comm: Comm, label: str = "") -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if comm.world_size == 1:
        return [obj]
    out: list[Any] = [None] * comm.world_size
    call = comm.start("all_gather_object", label, None)
    started = time.perf_counter()
    dist.all_gather_object(out, obj, group=comm.group)
    comm.finish(call, time.perf_counter() - started)
    return out


def barrier(comm: Comm, label: str = "") -> None:
    if comm.world_size > 1:
        call = comm.start("barrier", label, None)
        started = time.perf_counter()
        dist.barrier(group=comm.group)
        comm.finish(call, time.perf_counter() - started)


def broadcast_object(obj: Any, comm: Comm, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    if comm.world_size == 1:
        return obj
    box = [obj]
    call = comm.start("broadcast_object", "", None)
    started = time.perf_counter()
    dist.broadcast_object_list(box, src=src, group=comm.group)
    comm.finish(call, time.perf_counter() - started)
    return box[0]


def choose_transports(comm: Comm, numel: int, dtype: torch.dtype, choice: str = "auto") -> dict[str, Any]:
    """Settle how all-gathers and reduce-scatters travel: ``choice`` 'builtin' or 'pairwise', or 'auto':
    time both on a flat parameter of ``numel`` elements and keep the faster (the slowest rank's times
    decide, so every rank agrees). NCCL keeps its own collectives. Returns what was measured."""
    if comm.world_size == 1 or comm.backend == "nccl" or comm.stages_through_cpu:
        return {}
    if choice != "auto":
        comm.transports = {"all_gather": TRANSPORTS[choice], "reduce_scatter": TRANSPORTS[choice]}
        return {}
    times = torch.tensor(time_transports(numel, dtype, comm.group, comm.rank, comm.world_size), dtype=torch.float64)
    ag_builtin, rs_builtin, ag_pairwise, rs_pairwise = all_reduce(times, comm, op="max", label="transport").tolist()
    comm.transports = {"all_gather": TRANSPORTS["pairwise" if ag_pairwise < ag_builtin else "builtin"],
                       "reduce_scatter": TRANSPORTS["pairwise" if rs_pairwise < rs_builtin else "builtin"]}
    return {"all_gather": (ag_builtin, ag_pairwise), "reduce_scatter": (rs_builtin, rs_pairwise)}
