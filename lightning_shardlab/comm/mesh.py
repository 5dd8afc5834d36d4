"""The groups one sharded model trains on: who shards with whom, and who is whose replica (hybrid sharding).

World W = R replica groups x G ranks (G = ``shard_group_size``, the whole world by default). Ranks are laid
out so consecutive ranks (one node, fast links) shard the model between them:

    W = 4, G = 2        shard groups (intra-group)      {0, 1}  {2, 3}
                        replica groups (cross-group)    {0, 2}  {1, 3}    same shard, one per shard group

Each shard group runs ZeRO stage 1, 2 or 3 at N = G exactly as a world of G would; the replica groups hold
equal shards, so a gradient is reduce-scattered inside the shard group, then its shard is all-reduced across
the replica group (2 (R-1)/R of 1/G of it per rank, over the slow links). With ``reshard_after_forward=k``
(stage 3) a unit is left sharded over k consecutive ranks after forward, so its backward all-gather stays in
that *reshard group* (torch FSDP2's int, ZeRO++'s hpZ):

    W = 4, G = 4, k = 2  reshard groups                  {0, 1}  {2, 3}

Every ``Comm`` of a mesh shares the world's ledger (each call filed under its ``scope``) and observers, so the
budget, the fingerprints and the watchdog see the calls of every group. Plain sharding (G = W, no k) has one
group: the world, and a replica group of one (no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.host_side import open_host_side

SCOPES = {
    "world": "every rank",
    "shard": "inside a shard group",
    "replica": "across shard groups",
    "reshard": "inside a reshard group",
}


def shard_groups(world: int, size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` ranks: [[0..size-1], [size..2 size-1], ...]."""
    return [list(range(g * size, (g + 1) * size)) for g in range(world // size)]


def replica_groups(world: int, size: int) -> list[list[int]]:
    """For each shard rank s, the ranks holding shard s in every shard group: [[s, s+size, ...], ...]."""
    return [list(range(s, world, size)) for s in range(size)]


def check_group_size(option: str, size: int, world: int, hint: str) -> None:
    """A clear error, before any collective, unless ``size`` ranks tile ``world``."""
    if size < 1 or world % size:
        raise ValueError(f"`{option}={size}` must divide the world size {world}. HINT: {hint}")


@dataclass
class Mesh:
    """This rank's Comms: ``world`` (agreements, metrics, checkpoints' plans), ``shard`` (the all-gathers and
    reduce-scatters of the flat parameters), ``replica`` (the cross-group average of each gradient shard) and
    ``reshard`` (stage 3 backward all-gathers with ``reshard_after_forward=k``; the shard group otherwise)."""

    world: Comm
    shard: Comm
    replica: Comm
    reshard: Comm

    @property
    def hybrid(self) -> bool:
        return self.replica.world_size > 1

    @property
    def regrouped(self) -> bool:
        """Whether backward all-gathers run in reshard groups smaller than the shard group."""
        return self.reshard is not self.shard

    def comms(self) -> list[Comm]:
        """Each distinct Comm once, in the same order on every rank (world first)."""
        out: list[Comm] = []
        for comm in (self.world, self.shard, self.replica, self.reshard):
            if all(comm is not seen for seen in out):
                out.append(comm)
        return out

    @staticmethod
    def flat(world: Comm) -> Mesh:
        """Plain sharding: the world shards the model, no replicas. Collective on NCCL (the host side)."""
        return Mesh(world, world, _no_replicas(world), world).with_host_sides()

    def with_host_sides(self) -> Mesh:
        """Collective: each NCCL group's gloo twin for host tensors (comm/host_side.py), every rank in this order."""
        for comm in self.comms():
            open_host_side(comm)
        return self

    @staticmethod
    def build(world: Comm, shard_group_size: int, reshard_size: int | None = None) -> Mesh:
        """Collective (every rank, same arguments): open the groups of a ``shard_group_size`` x replicas mesh,
        and reshard groups of ``reshard_size`` ranks inside each shard group (None: no reshard groups)."""
        w, g = world.world_size, shard_group_size
        if g == w and reshard_size in (None, w):
            return Mesh.flat(world)
        shard = world if g == w else _sub(world, "shard", shard_groups(w, g))
        replica = _sub(world, "replica", replica_groups(w, g)) if g < w else _no_replicas(world)
        reshard = shard
        if reshard_size is not None and reshard_size < g:
            reshard = _sub(world, "reshard", shard_groups(w, reshard_size))
        return Mesh(world, shard, replica, reshard).with_host_sides()


def _no_replicas(world: Comm) -> Comm:
    """The replica group when one shard group spans the world: every rank alone."""
    return _one(world, "replica", [[r] for r in range(world.world_size)])


def _one(world: Comm, scope: str, partition: list[list[int]]) -> Comm:
    """A group of this rank alone: nothing to communicate."""
    return Comm(
        rank=0,
        world_size=1,
        device=world.device,
        ledger=world.ledger,
        observers=world.observers,
        scope=scope,
        ranks=(world.rank,),
        partition=tuple(map(tuple, partition)),
        parent=world,
    )


def _sub(world: Comm, scope: str, partition: list[list[int]]) -> Comm:
    """Collective: open every group of ``partition`` (each rank in exactly one); this rank's as a Comm."""
    mine = next(ranks for ranks in partition if world.rank in ranks)
    if len(mine) == 1:
        return _one(world, scope, partition)
    group, _ = dist.new_subgroups_by_enumeration(partition, backend=dist.get_backend())
    return Comm(
        rank=mine.index(world.rank),
        world_size=len(mine),
        device=world.device,
        group=group,
        ledger=world.ledger,
        observers=world.observers,
        scope=scope,
        ranks=tuple(mine),
        partition=tuple(map(tuple, partition)),
        parent=world,
        transports=dict(world.transports),
    )
