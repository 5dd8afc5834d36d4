"""The step of a whole-tensor optimizer (Muon, Adafactor): on whole parameters, each on its owner rank only.

sharding/owners.py plans who owns what; here the plan is carried out around the optimizer's own update:

    1. gather     one all-to-all: each owner receives the pieces of the averaged gradient (and of the values,
                  unless it holds them whole) of the parameters it owns, and builds each whole parameter
    2. update     the optimizer's param groups hold, for the update alone, the owner's whole parameters (the
                  rest of the groups' parameters are left out on this rank); its state, keyed by the original
                  params between steps, sits beside them; the class's own update runs
    3. return     one all-to-all: each holder receives its piece of the new values into its master shard

Parameters without a gradient (frozen, unused) move nothing and are not stepped, as the unsharded optimizer
skips them. The optimizer's state of a parameter lives only on its owner (optimizer.py's load keeps only
those), so state memory is about 1/W of the total on each rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.flat_param import FlatParam, stub
from lightning_shardlab.sharding.owners import Geometry, Owned, Piece, assign_owners, exchange_numel, pieces_of
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.sharding.stand_ins import standing_in

Slot = tuple[FlatParam, int]  # a flat parameter, and the index of the parameter in it


class OwnerPlan:
    """The owners of one optimizer's parameters on this world, and where each parameter's pieces lie."""

    def __init__(self, optimizer: Optimizer, sharded: ShardedModel) -> None:
        mesh = sharded.mesh
        self.geo = Geometry(mesh.world.world_size, mesh.shard.world_size)
        self.rank = mesh.world.rank
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.key = tuple(map(id, self.params))
        where = {id(p): (fp, i) for fp in sharded.flat_params for i, p in enumerate(fp.params)}
        self.slots: dict[int, Slot] = {id(p): where[id(p)] for p in self.params}
        owners = assign_owners([(self._slot(p).name, p.numel()) for p in self.params], self.geo.world_size)
        self.entries: dict[int, Owned] = {id(p): self._owned(p, owners[self._slot(p).name]) for p in self.params}

    def _slot(self, param: Tensor):  # noqa: ANN202
        fp, i = self.slots[id(param)]
        return fp.layout.slots[i]

    def _owned(self, param: Tensor, owner: int) -> Owned:
        fp, _ = self.slots[id(param)]
        slot = self._slot(param)
        travel = not (fp.resident_full and fp.master is fp.shard)
        return Owned(slot.name, slot.shape, owner, pieces_of(fp.layout, slot), travel)

    def owns(self, param: Tensor) -> bool:
        return self.entries[id(param)].owner == self.rank

    def owned_names(self) -> list[str]:
        return [e.name for e in self.entries.values() if e.owner == self.rank]


def plan_of(optimizer: Optimizer, sharded: ShardedModel) -> OwnerPlan:
    """The optimizer's plan, made again when its parameters changed (``add_param_group``)."""
    plan = getattr(optimizer, "_shardlab_owners", None)
    if plan is None or plan.key != tuple(id(p) for group in optimizer.param_groups for p in group["params"]):
        plan = OwnerPlan(optimizer, sharded)
        optimizer._shardlab_owners = plan  # type: ignore[attr-defined]
    return plan


def stepped_count(optimizer: Optimizer) -> int:
    """How many steps ``optimizer`` took on whole parameters (the budget's exchanges per step)."""
    return getattr(optimizer, "_shardlab_whole_steps", 0)


def _master_view(plan: OwnerPlan, param: Tensor) -> nn.Parameter:
    fp, i = plan.slots[id(param)]
    return fp.master_params[i]


@contextmanager
def whole_tensors_in_place(optimizer: Optimizer, sharded: ShardedModel) -> Iterator[None]:
    """For the block: the optimizer's param groups hold this rank's owned parameters whole (values and averaged
    gradient), its state beside them; afterwards every holder gets its piece of the new values."""
    plan = plan_of(optimizer, sharded)
    stepped = [p for p in plan.params if _master_view(plan, p).grad is not None]
    optimizer._shardlab_whole_steps = stepped_count(optimizer) + 1  # type: ignore[attr-defined]
    wholes: dict[int, nn.Parameter] = {}
    for dtype in _dtypes(plan, stepped):
        wholes.update(_gather(plan, sharded, [p for p in stepped if _master_view(plan, p).dtype == dtype]))
    groups = [group["params"] for group in optimizer.param_groups]
    with standing_in(optimizer, wholes, keep_others=False):  # the parameters this rank does not own: left out
        yield
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params
    for dtype in _dtypes(plan, stepped):
        _return(plan, sharded, [p for p in stepped if _master_view(plan, p).dtype == dtype], wholes)


def _dtypes(plan: OwnerPlan, params: list[Tensor]) -> list[torch.dtype]:
    return sorted({_master_view(plan, p).dtype for p in params}, key=str)


def _gather(plan: OwnerPlan, sharded: ShardedModel, params: list[Tensor]) -> dict[int, nn.Parameter]:
    """Collective: the whole parameters this rank owns, with their averaged gradients (see the module doc)."""
    geo, me = plan.geo, plan.rank
    device = sharded.mesh.world.device
    dtype = _master_view(plan, params[0]).dtype if params else torch.float32
    sends: list[list[Tensor]] = [[] for _ in range(geo.world_size)]
    for p in params:
        e, (fp, i) = plan.entries[id(p)], plan.slots[id(p)]
        piece = _my_piece(e, geo, me)
        if piece is not None and geo.group_of(e.owner) == geo.group_of(me):
            grad = _master_view(plan, p).grad.reshape(-1)
            sends[e.owner].append(grad)
            if e.values_travel:
                sends[e.owner].append(fp.master[piece.lo : piece.lo + piece.n])
    recvs = {}
    wholes: dict[int, nn.Parameter] = {}
    for p in params:
        e, (fp, i) = plan.entries[id(p)], plan.slots[id(p)]
        if e.owner != me:
            continue
        value = fp.views[i].detach().to(dtype, copy=True) if not e.values_travel else None
        whole = nn.Parameter(torch.empty(e.shape, dtype=dtype, device=fp.master.device) if value is None else value)
        whole.grad = torch.empty(e.shape, dtype=dtype, device=fp.master.device)
        wholes[id(p)] = whole
        for piece in e.pieces:
            source = geo.rank(geo.group_of(me), piece.position)
            parts = [whole.grad.view(-1)[piece.a : piece.a + piece.n]]
            if e.values_travel:
                parts.append(whole.data.view(-1)[piece.a : piece.a + piece.n])
            recvs.setdefault(source, []).extend(parts)
    _exchange(sends, recvs, plan, sharded, dtype, device, "gather", params)
    return wholes


def _return(plan: OwnerPlan, sharded: ShardedModel, params: list[Tensor], wholes: dict[int, nn.Parameter]) -> None:
    """Collective: every holder's piece of the new values of ``params``, into its master shard."""
    geo, me = plan.geo, plan.rank
    device = sharded.mesh.world.device
    dtype = _master_view(plan, params[0]).dtype if params else torch.float32
    sends: list[list[Tensor]] = [[] for _ in range(geo.world_size)]
    recvs: dict[int, list[Tensor]] = {}
    for p in params:
        e, (fp, _) = plan.entries[id(p)], plan.slots[id(p)]
        for piece in e.pieces:
            for group in range(geo.world_size // geo.shard_size):
                holder = geo.rank(group, piece.position)
                if e.owner == me:
                    sends[holder].append(wholes[id(p)].data.view(-1)[piece.a : piece.a + piece.n])
                if holder == me:
                    recvs.setdefault(e.owner, []).append(fp.master[piece.lo : piece.lo + piece.n])
    with torch.no_grad():
        _exchange(sends, recvs, plan, sharded, dtype, device, "return", params)


def _my_piece(e: Owned, geo: Geometry, rank: int) -> Piece | None:
    return next((piece for piece in e.pieces if piece.position == geo.position_of(rank)), None)


def _exchange(
    sends: list[list[Tensor]],
    recvs: dict[int, list[Tensor]],
    plan: OwnerPlan,
    sharded: ShardedModel,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    params: list[Tensor],
) -> None:
    """One all-to-all: ``sends[r]``'s tensors travel to rank r as one message; what rank r sends here lands in
    ``recvs[r]``'s tensors, in order. Every rank calls it (with nothing to move, too: the calls stay in step)."""
    geo = plan.geo
    gathered, returned = exchange_numel([plan.entries[id(p)] for p in params], geo)
    flat_sends = [_cat(parts, dtype, device) for parts in sends]
    flat_recvs = [
        torch.empty(sum(t.numel() for t in recvs.get(r, [])), dtype=dtype, device=device) for r in range(geo.world_size)
    ]
    collectives.all_to_all(
        flat_sends, flat_recvs, sharded.mesh.world, gathered if what == "gather" else returned, f"whole-tensor {what}"
    )
    with torch.no_grad():
        for r, parts in recvs.items():
            for part, value in zip(parts, flat_recvs[r].split([t.numel() for t in parts])):
                part.copy_(value.view_as(part))


def _cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.detach().reshape(-1).to(device, dtype) for t in parts])


def state_placeholder(param: Tensor, plan: OwnerPlan) -> Tensor:
    """What a parameter stands for while its optimizer loads state: its whole shape, the master's dtype and
    device, no memory (loaded values are cast to the dtype and device of the tensor they belong to)."""
    master = _master_view(plan, param)
    return stub(param.shape, master.dtype, master.device)
