"""This machine's link, measured: for ``shardlab plan --interconnect local`` (two gloo ranks of its own, timed by
comm/link_probe.py), and for a run's own prediction (its own group, timed with its own collectives at the end).

Both time a one-element all-gather (the latency of one call) and one of ``nbytes`` per rank (its bandwidth), as
a ring of the group's size moves them: (N-1)/N of the full tensor crosses each rank's link.
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_shardlab.budget.predicted.zero_table import Interconnect
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.link_probe import time_local_all_gathers


def _link(name: str, latency: float, seconds: float, nbytes: int, world_size: int) -> Interconnect:
    """``nbytes``: one rank's shard; a ring all-gather brings each rank the other N-1 shards."""
    crossing = (world_size - 1) * nbytes
    bandwidth = crossing / max(seconds - latency, 1e-9)
    return Interconnect(f"{name}: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us", bandwidth, latency)


def measure_local_link(nbytes: int = 16 * 2**20, repeats: int = 5) -> Interconnect:
    """The latency of a tiny all-gather and the bandwidth of a 16 MiB one, between two ranks on this machine."""
    latency, seconds = time_local_all_gathers(nbytes, repeats)
    bandwidth = (1 / 2) * nbytes / max(seconds - latency, 1e-9)  # a ring of 2: half the full tensor crosses
    return Interconnect(f"local, measured: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us", bandwidth, latency)


def measure_run_link(comm: Comm, nbytes: int = 4 * 2**20, repeats: int = 3) -> Interconnect:
    """Collective (every rank of ``comm``): the run's own link, timed with its own all-gathers (its transport, its
    ranks), the slowest rank's medians deciding so that every rank predicts from the same link."""
    times = []
    for numel in (1, nbytes // 4):
        shard = torch.zeros(numel, device=comm.device)
        full = torch.empty(numel * comm.world_size, device=comm.device)
        samples = []
        for _ in range(repeats + 1):  # the first warms the path up
            started = time.perf_counter()
            collectives.all_gather(full, shard, comm, label="link probe", kind="budget")
            samples.append(time.perf_counter() - started)
        times.append(statistics.median(samples[1:]))
    slowest = collectives.all_reduce(torch.tensor(times, dtype=torch.float64), comm, op="max", label="link probe")
    latency, seconds = slowest.tolist()
    return _link(f"this run's {comm.scope} group, measured", latency, seconds, nbytes // 4 * 4, comm.world_size)
