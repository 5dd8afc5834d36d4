"""``shardlab plan --interconnect local``: this machine's link, measured with two gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

from lightning_shardlab.budget.predict import Interconnect


def measure_local_link(nbytes: int = 16 * 2**20, repeats: int = 5) -> Interconnect:
    """Two gloo ranks on this machine: the latency of a tiny all-gather and the bandwidth of a 16 MiB one."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_calibrate, args=(port, nbytes, repeats, queue), nprocs=2, join=True)
    latency, seconds = queue.get()
    bandwidth = (1 / 2) * nbytes / max(seconds - latency, 1e-9)  # a ring of 2: half the full tensor crosses
    return Interconnect(f"local, measured: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us", bandwidth, latency)


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
