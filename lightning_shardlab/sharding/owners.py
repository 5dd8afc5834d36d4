"""Owner ranks for whole-tensor optimizers (Muon, Adafactor): who steps each parameter, and what moves. Pure.

A whole-tensor optimizer's update of a parameter reads the whole parameter (Muon orthogonalises each matrix,
Adafactor factors its second moment into row and column statistics), so it cannot run on the flat shards.
Each parameter it steps gets one *owner* among all W ranks of the world, chosen once from the names and sizes
alone (the same on every rank, stable across steps): the largest parameters first, each to the rank that
owns the fewest elements so far (ties: the lower rank). Owned elements, optimizer state and update work are
so balanced at about 1/W each, and every update runs on exactly one rank.

A parameter lies in the flat shards of its shard group (G ranks; W = R x G with hybrid sharding, R replica
groups holding equal shards). Shard position s holds one *piece* of it: the elements ``[a, a + n)`` of the
flattened parameter, at ``[lo, hi)`` of its master shard (possibly none). One optimizer step, per dtype:

    gather    every holder in the owner's shard group sends the owner its piece of the averaged gradient
              (and of the values, unless the owner holds them whole already: the resident fp32 full buffer of
              stages 1-2); one all-to-all over the world
    update    the owner runs the optimizer's own update on the whole parameter, its state kept there alone
    return    the owner sends each holder, in every shard group, its piece of the new values; one all-to-all

This module computes that plan; sharding/whole_step.py carries it out, the budget predicts its bytes from it
(for a running optimizer, and from a layout alone for ``shardlab plan``: ``pieces_of``, ``sent_by_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_shardlab.sharding.flat_param import FlatParamLayout, ParamSlot


@dataclass(frozen=True)
class Piece:
    """What shard position ``position`` holds of one parameter: its elements ``[a, a + n)`` (flattened), at
    ``[lo, lo + n)`` of that position's master shard."""

    position: int
    lo: int
    a: int
    n: int


@dataclass(frozen=True)
class Owned:
    """One parameter of a whole-tensor optimizer: its owner (a world rank) and its pieces (non-empty ones)."""

    name: str
    shape: torch.Size
    owner: int
    pieces: tuple[Piece, ...]
    values_travel: bool  # the owner gathers the values too (stage 3, a master apart from the compute copy)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def assign_owners(sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """name -> owner rank: largest first, each to the least-loaded rank (ties: lower rank; equal sizes by name)."""
    load = [0] * world_size
    owners = {}
    for name, numel in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += numel
    return owners


@dataclass(frozen=True)
class Geometry:
    """Where ranks sit: W = groups x G, world rank = group * G + position (comm/mesh.py's layout)."""

    world_size: int
    shard_size: int

    def rank(self, group: int, position: int) -> int:
        return group * self.shard_size + position

    def group_of(self, rank: int) -> int:
        return rank // self.shard_size

    def position_of(self, rank: int) -> int:
        return rank % self.shard_size


def gather_counts(entries: list[Owned], geo: Geometry, rank: int) -> tuple[list[int], list[int]]:
    """Elements ``rank`` sends to and receives from each world rank in the gather (its own piece not counted)."""
    send, recv = [0] * geo.world_size, [0] * geo.world_size
    for e in entries:
        factor = 2 if e.values_travel else 1
        group = geo.group_of(e.owner)
        for piece in e.pieces:
            source = geo.rank(group, piece.position)
            if source == e.owner:
                continue
            if source == rank:
                send[e.owner] += factor * piece.n
            if e.owner == rank:
                recv[source] += factor * piece.n
    return send, recv


def return_counts(entries: list[Owned], geo: Geometry, rank: int) -> tuple[list[int], list[int]]:
    """Elements ``rank`` sends to and receives from each world rank when the new values go back."""
    send, recv = [0] * geo.world_size, [0] * geo.world_size
    for e in entries:
        for piece in e.pieces:
            for group in range(geo.world_size // geo.shard_size):
                holder = geo.rank(group, piece.position)
                if holder == e.owner:
                    continue
                if e.owner == rank:
                    send[holder] += piece.n
                if holder == rank:
                    recv[e.owner] += piece.n
    return send, recv


def exchange_numel(entries: list[Owned], geo: Geometry) -> tuple[int, int]:
    """Elements the whole gather and the whole return move, over every pair of ranks (the same on every rank:
    what each call's fingerprint carries)."""
    gathered = sum(sum(gather_counts(entries, geo, r)[0]) for r in range(geo.world_size))
    returned = sum(sum(return_counts(entries, geo, r)[0]) for r in range(geo.world_size))
    return gathered, returned


def pieces_of(layout: FlatParamLayout, slot: ParamSlot) -> tuple[Piece, ...]:
    """The non-empty pieces of ``slot`` in ``layout``'s shards, from the layout alone (what a running flat
    parameter's shards hold)."""
    pieces = []
    for position in range(layout.world_size):
        lo, hi = layout.slot_in_shard(slot, position)
        if hi > lo:
            pieces.append(Piece(position, lo, layout.shard_range(position)[0] + lo - slot.offset, hi - lo))
    return tuple(pieces)


def sent_by_rank(entries: list[Owned], geo: Geometry) -> dict[str, list[int]]:
    """Elements each world rank sends in one gather and in one return of ``entries`` (its own pieces not
    counted; what ``gather_counts`` and ``return_counts`` give rank by rank, in one pass for any world size),
    and "across": the part of the return that leaves the owner's shard group (hybrid)."""
    out = {key: [0] * geo.world_size for key in ("gather", "return", "across")}
    groups = geo.world_size // geo.shard_size
    for e in entries:
        factor = 2 if e.values_travel else 1
        for piece in e.pieces:
            source = geo.rank(geo.group_of(e.owner), piece.position)
            if source != e.owner:
                out["gather"][source] += factor * piece.n
            own = piece.n if source == e.owner else 0
            out["return"][e.owner] += groups * piece.n - own
            out["across"][e.owner] += (groups - 1) * piece.n
    return out
