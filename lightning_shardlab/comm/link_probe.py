"""Two gloo ranks on this machine, timed: what ``shardlab plan --interconnect local`` turns into a link.

Its own two processes and process group, outside any run (no ledger, no Comm): it measures the raw link, the way
budget/measured/local_link.py times a run's own (batches of all-gathers launched together, at two sizes).
"""

from __future__ import annotations

from typing import Any


def time_local_all_gathers(sizes: tuple[int, ...], calls: int, repeats: int) -> list[float]:
    """Median seconds of ``calls`` all-gathers launched together and waited for, of each of ``sizes`` bytes per
    rank, on two local ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_calibrate, args=(port, sizes, calls, repeats, queue), nprocs=2, join=True)
    return queue.get()


def _calibrate(rank: int, port: int, sizes: tuple[int, ...], calls: int, repeats: int, queue: Any) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = []
    for nbytes in sizes:
        shard, fulls = torch.ones(nbytes // 4), [torch.empty(2 * (nbytes // 4)) for _ in range(calls)]
        samples = []
        for _ in range(repeats + 1):  # the first warms the path up
            dist.barrier()
            start = time.perf_counter()
            for work in [dist.all_gather_single(full, shard, async_op=True) for full in fulls]:
                work.wait()
            samples.append(time.perf_counter() - start)
        timings.append(statistics.median(samples[1:]))
    if rank == 0:
        queue.put(timings)
    dist.destroy_process_group()
