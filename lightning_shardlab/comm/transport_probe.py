"""Which transport each collective takes on gloo: both timed once at setup, the faster kept (comm/transport.py).

``choose_transports`` runs on the shard group at setup (sharding/build.py), on a flat parameter of the size the
model will move (its biggest, capped at ``PROBE_NUMEL``): every rank times torch's built-in all-gather and
reduce-scatter and the pairwise exchange, the slowest rank's times decide (one all-reduce, max), so every
rank keeps the same. NCCL keeps its own; ``transport='builtin'`` or ``'pairwise'`` skips the timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.transport import TRANSPORTS, Builtin, Launched, Pairwise

PROBE_NUMEL = 8 * 2**20  # the transports are timed on the biggest flat parameter, up to this size


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
    ag_builtin, rs_builtin, ag_pairwise, rs_pairwise = collectives.all_reduce(
        times, comm, op="max", label="transport"
    ).tolist()
    comm.transports = {
        "all_gather": TRANSPORTS["pairwise" if ag_pairwise < ag_builtin else "builtin"],
        "reduce_scatter": TRANSPORTS["pairwise" if rs_pairwise < rs_builtin else "builtin"],
    }
    return {"all_gather": (ag_builtin, ag_pairwise), "reduce_scatter": (rs_builtin, rs_pairwise)}


def _seconds(run: Callable[[], Launched], repeats: int) -> float:
    samples = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        launched = run()
        for work in launched.works:
            work.wait()
        if launched.finish is not None:
            launched.finish()
        if i:  # the first is a warm-up
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_transports(numel: int, dtype: torch.dtype, group: Any, rank: int, world: int, repeats: int = 3) -> list[float]:
    """This rank's seconds for [all-gather builtin, reduce-scatter builtin, all-gather pairwise, reduce-scatter
    pairwise] on a flat parameter of ``numel`` elements (every rank must call it)."""
    s = -(-numel // world)
    shard, full = torch.ones(s, dtype=dtype), torch.ones(s * world, dtype=dtype)  # no draws from the global RNG
    out_full, out_shard = torch.empty_like(full), torch.empty_like(shard)
    times = []
    for transport in (Builtin, Pairwise):
        times.append(_seconds(lambda t=transport: t.all_gather(out_full, shard, group, rank, world), repeats))
        times.append(_seconds(lambda t=transport: t.reduce_scatter_sum(out_shard, full, group, rank, world), repeats))
    return times
