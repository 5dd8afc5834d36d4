"""Two gloo ranks on this machine, timed: what ``shardlab plan --interconnect local`` turns into a link.

Its own two processes and process group, outside any run (no ledger, no Comm): it measures the raw link.
"""

from __future__ import annotations

from typing import Any

import torch


def time_local_all_gathers(nbytes: int = 16 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(median seconds of a one-element all-gather, of an all-gather of ``nbytes`` per rank) on two local ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_calibrate, args=(port, nbytes, repeats, queue), nprocs=2, join=True)
    return queue.get()


def _calibrate(rank: int, port: int, nbytes: int, repeats: int, queue: Any) -> None:
    import statistics
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = []
    for numel in (1, nbytes // 4):
        shard, full = torch.ones(numel), torch.empty(2 * numel)
        dist.all_gather_single(full, shard)  # warm up
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_single(full, shard)
            samples.append(time.perf_counter() - start)
        timings.append(statistics.median(samples))
    if rank == 0:
        queue.put(tuple(timings))
    dist.destroy_process_group()
