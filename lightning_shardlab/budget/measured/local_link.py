"""``shardlab plan --interconnect local``: this machine's link, from two gloo ranks timed by comm/link_probe.py."""

from __future__ import annotations

from lightning_shardlab.budget.predicted.zero_table import Interconnect
from lightning_shardlab.comm.link_probe import time_local_all_gathers


def measure_local_link(nbytes: int = 16 * 2**20, repeats: int = 5) -> Interconnect:
    """The latency of a tiny all-gather and the bandwidth of a 16 MiB one, between two ranks on this machine."""
    latency, seconds = time_local_all_gathers(nbytes, repeats)
    bandwidth = (1 / 2) * nbytes / max(seconds - latency, 1e-9)  # a ring of 2: half the full tensor crosses
    return Interconnect(f"local, measured: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us", bandwidth, latency)
