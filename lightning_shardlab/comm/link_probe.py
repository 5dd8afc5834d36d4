"""Timing a link with batches of all-gathers launched together and waited for, at several sizes per rank: a run's
own groups (budget/measured/local_link.py's ``measure_run_link``), and two gloo ranks of their own on this machine,
outside any run, for ``shardlab plan --interconnect local`` (``time_local_all_gathers``). Both time the same calls
through the collectives module, filed under the kind "budget", apart from parameter traffic.

On a CPU, a call also costs the rank that computes around it, as the engine's ranks do (launch a gather, compute a
unit, wait): the compute its launch and the communication threads take from the cores, and a wait that lasts until
the peers' threads get a core. Batches timed while every rank waits see neither, and a small model's step on two
cores shared by two ranks is mostly these costs (benchmarks/TIME_PREDICTION.md), so ``time_busy_call`` times them
apart: the same loop of compute with and without a small call around each chunk. In a training run's processes the
split between the two moves from one measurement to the next (here 0.2-2.4 ms of compute and 0.15-1.3 ms of wait a
call, the same calls), their sum much less (0.9-1.6 ms); at ``link_share`` 0 a second of either costs the step the
same (benchmarks/TIME_PREDICTION.md, "Ways to price a call").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm


@dataclass(frozen=True)
class GatherTimes:
    """A probe's medians: seconds per batch at each size, and what one small call costs a busy rank."""

    batches: list[float]
    launch: float  # seconds of compute one small call takes from a busy rank (``time_busy_call``)
    wait: float  # seconds its wait blocks that rank


BUSY_BYTES = 1 << 10  # bytes per rank of the calls timed inside a busy loop: within every wire's receive room, so
# that launching them never waits for a peer's header (larger payloads do: comm/wire.py)
BUSY_CALLS = 10  # calls per busy loop
BUSY_SECONDS = 5e-4  # seconds of compute between a call's launch and its wait, as a unit's forward between its
# gather's launch and the next unit's wait


def _batch(comm: Comm, shard: torch.Tensor, fulls: list[torch.Tensor], aligned: bool) -> float:
    """Seconds of one batch of all-gathers launched together, then waited for."""
    if aligned:
        collectives.barrier(comm, label="link probe")
    started = time.perf_counter()
    batch = [
        collectives.all_gather(full, shard, comm, label="link probe", kind="budget", async_op=True) for full in fulls
    ]
    for call in batch:
        call.wait()
    return time.perf_counter() - started


def _busy_loop(comm: Comm, work: torch.Tensor, chunk: int, with_calls: bool) -> tuple[float, float]:
    """``BUSY_CALLS`` chunks of compute, each with (``with_calls``) a small all-gather launched before it and waited
    for after it, the ranks starting together: (seconds in all, seconds in waits)."""
    shard = torch.zeros(BUSY_BYTES // 4, device=comm.device)
    full = torch.empty(BUSY_BYTES // 4 * comm.world_size, device=comm.device)
    collectives.barrier(comm, label="link probe")
    waiting, started = 0.0, time.perf_counter()
    for _ in range(BUSY_CALLS):
        call = None
        if with_calls:
            call = collectives.all_gather(full, shard, comm, label="link probe", kind="budget", async_op=True)
        for _ in range(chunk):
            work @ work
        at = time.perf_counter()
        if call is not None:
            call.wait()
        waiting += time.perf_counter() - at
    return time.perf_counter() - started, waiting


def time_busy_call(comm: Comm, repeats: int) -> tuple[float, float]:
    """Collective: what one small call costs a rank that computes around it (the engine's pattern: launch, compute,
    wait), beyond that compute: (seconds of compute it takes: its launch and the compute slowed by communication
    threads sharing the cores; seconds its wait blocks). Medians over ``repeats`` of a loop with calls against the
    same loop without, per call; 0 at least."""
    work = torch.randn(64, 64, device=comm.device)
    began = time.perf_counter()
    for _ in range(20):
        work @ work
    chunk = max(1, round(BUSY_SECONDS / max((time.perf_counter() - began) / 20, 1e-7)))
    _busy_loop(comm, work, chunk, True)  # warms the path up
    compute, blocked = [], []
    for _ in range(repeats):
        (calls, waiting), (alone, _) = (_busy_loop(comm, work, chunk, c) for c in (True, False))
        compute.append(calls - waiting - alone)
        blocked.append(waiting)
    return tuple(max(statistics.median(v) / BUSY_CALLS, 0.0) for v in (compute, blocked))  # type: ignore[return-value]


def time_gather_batches(
    comm: Comm, sizes: tuple[int, ...], calls: int, repeats: int, aligned: bool = False
) -> GatherTimes:
    """Collective: for each of ``sizes`` (bytes per rank), this rank's median seconds of ``calls`` all-gathers
    launched together and waited for, over ``repeats`` batches after one that warms the path up; then, on a CPU,
    what one small call costs a busy rank (``time_busy_call``; 0 on a GPU). ``aligned``: a barrier before each
    batch, so every rank starts it together."""
    timings = []
    for nbytes in sizes:
        shard = torch.zeros(nbytes // 4, device=comm.device)
        fulls = [torch.empty(nbytes // 4 * comm.world_size, device=comm.device) for _ in range(calls)]
        samples = [_batch(comm, shard, fulls, aligned) for _ in range(repeats + 1)][1:]  # the first warms up
        timings.append(statistics.median(samples))
    if comm.device.type != "cpu":  # a GPU's host queues its calls ahead of the device, whose kernels they overlap
        return GatherTimes(timings, 0.0, 0.0)
    return GatherTimes(timings, *time_busy_call(comm, max(3, repeats // 3)))


def time_local_all_gathers(sizes: tuple[int, ...], calls: int, repeats: int) -> GatherTimes:
    """``time_gather_batches`` on two local ranks of their own (gloo), each batch started together: rank 0's
    medians."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_calibrate, args=(port, sizes, calls, repeats, queue), nprocs=2, join=True)
    return queue.get()


def _calibrate(rank: int, port: int, sizes: tuple[int, ...], calls: int, repeats: int, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = time_gather_batches(
        Comm(rank=rank, world_size=2, device=torch.device("cpu")), sizes, calls, repeats, True
    )
    if rank == 0:
        queue.put(timings)
    dist.destroy_process_group()
