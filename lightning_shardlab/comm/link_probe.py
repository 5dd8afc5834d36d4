"""Timing a link with batches of all-gathers launched together and waited for, at several sizes per rank: a run's
own groups (budget/measured/local_link.py's ``measure_run_link``), and two gloo ranks of their own on this machine,
outside any run, for ``shardlab plan --interconnect local`` (``time_local_all_gathers``). Both time the same calls
through the collectives module, filed under the kind "budget", apart from parameter traffic.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm


def time_gather_batches(
    comm: Comm, sizes: tuple[int, ...], calls: int, repeats: int, aligned: bool = False
) -> list[float]:
    """Collective: for each of ``sizes`` (bytes per rank), this rank's median seconds of ``calls`` all-gathers
    launched together and waited for, over ``repeats`` batches after one that warms the path up. ``aligned``: a
    barrier before each batch, so every rank starts it together."""
    timings = []
    for nbytes in sizes:
        shard = torch.zeros(nbytes // 4, device=comm.device)
        fulls = [torch.empty(nbytes // 4 * comm.world_size, device=comm.device) for _ in range(calls)]
        samples = []
        for _ in range(repeats + 1):  # the first warms the path up
            if aligned:
                collectives.barrier(comm, label="link probe")
            started = time.perf_counter()
            batch = [
                collectives.all_gather(full, shard, comm, label="link probe", kind="budget", async_op=True)
                for full in fulls
            ]
            for call in batch:
                call.wait()
            samples.append(time.perf_counter() - started)
        timings.append(statistics.median(samples[1:]))
    return timings


def time_local_all_gathers(sizes: tuple[int, ...], calls: int, repeats: int) -> list[float]:
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
