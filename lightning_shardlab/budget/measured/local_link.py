"""This machine's link, measured: for ``shardlab plan --interconnect local`` (two gloo ranks of its own, timed by
comm/link_probe.py), and for a run's own prediction (its own group, timed with its own collectives at the end).

Both time batches of ``CALLS`` all-gathers launched together and waited for (as the engine keeps several in flight:
the refresh after an optimizer step, a prefetch behind a unit's gather), at two sizes per rank. A ring all-gather
of ``b`` bytes per rank on N ranks costs ``(N-1) x latency + (N-1) x b / bandwidth`` (``Interconnect.ring_seconds``),
and calls on one link follow each other, so a batch takes ``CALLS`` times that: the bandwidth is the slope between
the two sizes and the latency what is left of the small batch. Two sizes, not a one-element call for the latency:
on a shared machine one tiny call's time jumps many-fold between runs (a message too small to be pushed at once
waits for the stack's timer) while calls of real size do not, and subtracting such a latency from a large call's
time made a link read several times too fast. On a CPU the probe also times a small call inside a busy loop
(comm/link_probe.py's ``time_busy_call``): the compute each call takes (``Interconnect.launch``) and its wait, the
latency a busy rank sees, which the link takes when it is the longer (0 and the batches' alone on a GPU).
"""

from __future__ import annotations

import torch

from lightning_shardlab.budget.predicted.zero_table import Interconnect
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.link_probe import time_gather_batches, time_local_all_gathers

CALLS = 4  # all-gathers per timed batch
SIZES = (64 * 2**10, 4 * 2**20)  # bytes per rank of each call: the small and the large batch
GATHERED = 64 * 2**20  # bytes: the most a run's probe gathers at once (its large calls shrink on many ranks)
REPEATS = 15  # timed batches per size, their median kept: with 3, the fitted latency moved 10x between runs here


def fit_link(
    name: str,
    seconds: list[float],
    world_size: int,
    sizes: tuple[int, int] = SIZES,
    launch: float = 0.0,
    busy_wait: float = 0.0,
) -> Interconnect:
    """The link whose ring all-gathers take ``seconds`` for a batch of ``CALLS`` calls of each of ``sizes`` bytes
    per rank on ``world_size`` ranks: bandwidth from the slope, latency from the intercept (at least 0): what calls
    waited for back to back see; a busy rank's latency, the ``busy_wait`` of one small call over its N-1 messages
    where that is longer: what calls see that their rank computed beside; ``launch`` the compute one call takes
    (``time_busy_call``)."""
    (small, large), (t_small, t_large) = sizes, seconds
    hops = CALLS * (world_size - 1)  # messages of one rank per batch, each of one shard
    if t_large > t_small:
        bandwidth = hops * (large - small) / (t_large - t_small)
        latency = max(t_small - hops * small / bandwidth, 0.0) / hops
    else:  # noise swamped the difference: the large batch alone, its latency counted as transfer
        bandwidth, latency = hops * large / t_large, 0.0
    busy = max(busy_wait / max(world_size - 1, 1), latency)
    waits = f" ({busy * 1e6:.0f} us beside compute)" if busy > latency else ""
    posted = f", {launch * 1e6:.0f} us of compute a call" if launch else ""
    name = f"{name}: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us{waits}{posted}"
    return Interconnect(name, bandwidth, latency, launch, busy)


def measure_local_link(repeats: int = REPEATS) -> Interconnect:
    """The link between two ranks of their own on this machine (gloo), from batches of all-gathers at two sizes."""
    times = time_local_all_gathers(SIZES, CALLS, repeats)
    return fit_link("local, measured", times.batches, 2, launch=times.launch, busy_wait=times.wait)


def measure_run_link(comm: Comm, repeats: int = REPEATS) -> Interconnect:
    """Collective (every rank of ``comm``): the run's own link, timed with its own all-gathers (its transport, its
    ranks), the slowest rank's medians deciding so that every rank predicts from the same link."""
    sizes = (SIZES[0], max(2 * SIZES[0], min(SIZES[1], GATHERED // (CALLS * comm.world_size)) // 4 * 4))
    times = time_gather_batches(comm, sizes, CALLS, repeats)
    figures = torch.tensor([*times.batches, times.launch, times.wait], dtype=torch.float64)
    slowest = collectives.all_reduce(figures, comm, op="max", label="link probe").tolist()
    name = f"this run's {comm.scope} group, measured"
    return fit_link(name, slowest[:2], comm.world_size, sizes, launch=slowest[2], busy_wait=slowest[3])
