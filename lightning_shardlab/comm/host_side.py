"""The host side: a gloo group beside each NCCL group, for the facts that live on the host.

Some of what the ranks agree on is known to the host, not computed on the device: which parameters got a
gradient this step (sharding/unused_params.py), whether a background save has ended, the guard's fingerprints of
the collectives issued, the budget's per-rank figures and step clocks, every pickled object and every barrier.
On an NCCL group each of these would travel as a device tensor: copied up to the GPU (the host waits for the
copy), reduced, and copied back (the host waits for everything queued before it), so the CPU could never run
ahead of the GPU: the next unit's kernels and collectives would not be queued while this one computes. They
travel on gloo instead, as host tensors, between the same ranks; the device's queue is not touched.

On gloo (CPU ranks, ranks sharing a GPU) a group carries host tensors itself: its host side is the group. Each
NCCL group of a mesh (comm/mesh.py) opens its host side when it is opened, every rank at the same point; the host
side shares its group's ledger, observers and rank (the watchdog sees a rank blocked in either), and it is
verified like any group (sharding/sharded_model.py ``verify_collectives``).

    open_host_side(comm)    collective: give an NCCL ``comm`` its gloo twin (``comm.host``)
    comm.host_side          where host tensors travel: ``comm.host``, or ``comm`` itself on gloo
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_shardlab.comm.collectives import Comm

ALWAYS = False  # open a host side on gloo groups too: the tests run NCCL's arrangement on CPU ranks with it


def open_host_side(comm: Comm) -> None:
    """Collective over the world (every rank, same point, same kind of group): open ``comm.host``, a gloo group of
    the same ranks, when ``comm`` is an NCCL group (or always, under ``ALWAYS``). Nothing at world size 1."""
    if comm.host is not None or comm.world_size == 1 or not (ALWAYS or comm.backend == "nccl"):
        return
    if comm.partition is None:
        group = dist.new_group(backend="gloo")
    else:
        group, _ = dist.new_subgroups_by_enumeration([list(p) for p in comm.partition], backend="gloo")
    comm.host = Comm(
        rank=comm.rank,
        world_size=comm.world_size,
        device=torch.device("cpu"),
        group=group,
        ledger=comm.ledger,
        observers=comm.observers,
        scope=comm.scope,
        ranks=comm.ranks,
        partition=comm.partition,
        parent=comm.parent or comm,
        side="host",
    )
