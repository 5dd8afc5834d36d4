"""The budget of whole-tensor optimizers (Muon, Adafactor): what each rank owns, the state it holds for it, and what
the owners' exchanges move per step, from the owner plan (sharding/owners.py): for a run (``ShardLabBudget`` prints
it beside what it measured) and before one (``shardlab plan --optimizer muon|adafactor``).

Optimizer state per owned parameter of shape (..., m, n), in the master's dtype:

    Muon        the momentum buffer, whole: m n elements
    Adafactor   matrices: row and column statistics, numel / n + numel / m elements, and a float32 step;
                vectors: a whole second moment and the step
    any other   the state of the elementwise class it derives from, whole (SGD with momentum: one buffer);
                a class of its own, whose state nothing tells before it steps: two moments and a step, as Adam's

Beside them, elementwise optimizers keep their state of each parameter's slice in this rank's shard. A plan from a
model steps its layout at shard group size G by the usual recipe (Muon: trainable parameters of 2+ dimensions in
units other than the root, AdamW the rest; Adafactor: every trainable parameter), owners from ``assign_owners``; from
a count, the 1/W ideal, every parameter stepped whole (Adafactor's state then an upper bound). Per step, a gather and
a return per master dtype (all-to-alls over the world): each holder sends the owner its piece of the averaged
gradient (and of the values, unless the owner holds them whole), the owner each holder its piece of the new values.
A rank's figure is what it sends, as a ledger counts an all-to-all; "across" leaves the owner's shard group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.core.config import PrecisionPolicy, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout, ParamSlot
from lightning_shardlab.sharding.optimizer import ELEMENTWISE, OptimizerShape, is_whole_tensor
from lightning_shardlab.sharding.owners import (
    Geometry,
    Owned,
    assign_owners,
    exchange_numel,
    gather_counts,
    pieces_of,
    return_counts,
    sent_by_rank,
)
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.sharding.whole_step import plan_of, stepped_count

STEP_BYTES = 4  # a float32 step counter (Adafactor)


ADAM_LIKE = OptimizerShape(per_element=2, scalar_bytes=STEP_BYTES)  # what a class of its own is predicted to keep


def whole_state_bytes(
    cls: type[Optimizer], shape: torch.Size, itemsize: int, elementwise: OptimizerShape = ADAM_LIKE
) -> int:
    """Bytes of the state an optimizer of class ``cls`` keeps for one whole parameter of ``shape`` (the module's
    docstring); any class but Muon's and Adafactor's by ``elementwise``, its state per element (``state_shape_of``)."""
    numel = shape.numel()
    if issubclass(cls, torch.optim.Muon):
        return numel * itemsize
    if issubclass(cls, torch.optim.Adafactor):
        if len(shape) >= 2:
            return (numel // shape[-1] + numel // shape[-2]) * itemsize + STEP_BYTES
        return numel * itemsize + STEP_BYTES
    return elementwise.per_element * numel * itemsize + elementwise.scalar_bytes


def state_shape_of(optimizer: Optimizer) -> OptimizerShape:
    """The state per element of a whole-tensor optimizer that is neither Muon nor Adafactor: its elementwise base
    class's, with its hyperparameters (SGD's momentum), else Adam's."""
    known = any(issubclass(type(optimizer), base) for base in ELEMENTWISE)
    return OptimizerShape.of(optimizer) if known else ADAM_LIKE


def _owned_state(optimizer: Optimizer, owned: list[Tensor], masters: dict[int, Any]) -> int:
    """The state a whole-tensor ``optimizer`` is predicted to keep for the trained parameters this rank owns."""
    per = state_shape_of(optimizer)
    return sum(
        whole_state_bytes(type(optimizer), p.shape, masters[id(p)][1].element_size(), per)
        for p in owned
        if p.requires_grad
    )


def state_bytes_predicted(sharded: ShardedModel, optimizers: list[Optimizer]) -> int:
    """This rank's optimizer state in bytes, each parameter by the optimizer that holds it."""
    masters = sharded.master_params_by_id()
    total = 0
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if is_whole_tensor(optimizer):
            plan = plan_of(optimizer, sharded)
            total += _owned_state(optimizer, [p for p in params if plan.owns(p)], masters)
            continue
        shape = OptimizerShape.of(optimizer)
        for p in params:
            master = masters[id(p)][1]
            total += master.numel() * shape.per_element * master.element_size() + shape.scalar_bytes
    return total


def _exchange_per_step(sharded: ShardedModel, optimizer: Optimizer) -> tuple[int, int]:
    """(calls, bytes this rank sends) of one step of ``optimizer``: a gather and a return per master dtype."""
    plan = plan_of(optimizer, sharded)
    if plan.geo.world_size == 1:
        return 0, 0
    by_dtype: dict[torch.dtype, list[Any]] = {}
    for p in plan.params:
        if p.requires_grad:
            by_dtype.setdefault(plan.slots[id(p)][0].master.dtype, []).append(plan.entries[id(p)])
    calls = nbytes = 0
    for dtype, entries in by_dtype.items():
        calls += 2
        sent = gather_counts(entries, plan.geo, plan.rank)[0] + return_counts(entries, plan.geo, plan.rank)[0]
        nbytes += sum(sent) * dtype.itemsize
    return calls, nbytes


def whole_tensor_report(sharded: ShardedModel, optimizers: list[Optimizer], global_steps: int) -> dict[str, Any]:
    """Per whole-tensor optimizer: parameters, those this rank owns (count, elements), their state measured and
    predicted, its steps; and the exchanges predicted per optimizer step of the run (``global_steps``: the
    Trainer's count, in which each optimizer's step counts)."""
    masters = sharded.master_params_by_id()
    out: dict[str, Any] = {"optimizers": [], "all_to_all_calls": 0.0, "all_to_all_bytes": 0.0}
    for index, optimizer in enumerate(optimizers):
        if not is_whole_tensor(optimizer):
            continue
        plan = plan_of(optimizer, sharded)
        owned = [p for p in plan.params if plan.owns(p)]
        measured = sum(
            v.untyped_storage().nbytes()
            for p in owned
            for v in optimizer.state.get(p, {}).values()
            if isinstance(v, Tensor)
        )
        predicted = _owned_state(optimizer, owned, masters)
        steps = stepped_count(optimizer)
        calls, nbytes = _exchange_per_step(sharded, optimizer)
        share = steps / max(global_steps, 1)  # its steps per step of the run (1/2 beside a second optimizer)
        exchange = {"calls": calls * share, "bytes": nbytes * share}  # this rank sends, per step of the run
        out["all_to_all_calls"] += exchange["calls"]
        out["all_to_all_bytes"] += exchange["bytes"]
        gathered, returned = exchange_numel([plan.entries[id(p)] for p in plan.params if p.requires_grad], plan.geo)
        out["optimizers"].append(
            {
                "index": index,
                "optimizer": type(optimizer).__name__,  # the user's class name (sharded_class keeps it)
                "params": len(plan.params),
                "owned": len(owned),
                "owned_numel": sum(p.numel() for p in owned),
                "total_numel": sum(p.numel() for p in plan.params),
                "state_bytes_measured": measured,
                "state_bytes_predicted": predicted,
                "steps": steps,
                "exchange_per_step": exchange,
                "exchange_numel_per_step": {"gather": gathered, "return": returned},  # over every pair of ranks
            }
        )
    return out


# ---- planned before the run ----

BESIDE_MUON = "adamw"  # what the usual recipe steps the rest with
SHOWN = 64  # ranks listed one by one, as the plan's per_rank

Units = dict[str, list[FlatParamLayout]]
Held = tuple[FlatParamLayout, ParamSlot]


@dataclass
class WholePlan:
    """A whole-tensor optimizer's figures, one entry per world rank: bytes (elements for ``owned_numel``)."""

    optimizer: str  # its class's name
    recipe: str  # which parameters it steps, and what steps the rest
    params: int  # the parameters it steps (0 from a count: no shapes)
    numel: float  # their elements
    calls: int  # all-to-alls per step: a gather and a return per master dtype
    owned_params: list[float]
    owned_numel: list[float]
    state: list[float]  # its state of the parameters each rank owns
    elementwise_state: list[float]  # AdamW's state of the rest, beside Muon
    gather: list[float]  # bytes each rank sends per step in the gathers
    give_back: list[float]  # in the returns
    across: list[float]  # of the returns, to other shard groups

    def optimizer_state(self, rank: int) -> float:
        return self.state[rank] + self.elementwise_state[rank]

    def sent(self, rank: int) -> float:
        return self.gather[rank] + self.give_back[rank]

    def rank_fields(self, rank: int) -> dict[str, float]:
        return {
            "owned_params": self.owned_params[rank],
            "owned_numel": self.owned_numel[rank],
            "state_bytes": self.state[rank],
            "elementwise_state_bytes": self.elementwise_state[rank],
            "gather_bytes": self.gather[rank],
            "return_bytes": self.give_back[rank],
            "across_bytes": self.across[rank],
        }

    def fields(self) -> dict[str, Any]:
        """The plan's ``whole_tensor`` entry: totals, the 1/W ideal, the fullest and the busiest rank, and the
        first ranks one by one."""
        world = len(self.state)
        fullest = max(range(world), key=lambda r: (self.state[r], -r))
        busiest = max(range(world), key=lambda r: (self.sent(r), -r))
        return {
            "optimizer": self.optimizer,
            "recipe": self.recipe,
            "params": self.params,
            "numel": self.numel,
            "calls_per_step": self.calls,
            "state_bytes_total": sum(self.state),
            "ideal_state_bytes_per_rank": sum(self.state) / world,
            "fullest_rank": {"rank": fullest, **self.rank_fields(fullest)},
            "busiest_rank": {"rank": busiest, **self.rank_fields(busiest)},
            "per_rank": [self.rank_fields(r) for r in range(min(world, SHOWN))],
        }


def recipe(cls: type[Optimizer], units: Units) -> tuple[list[Held], list[Held], str]:
    """(the trainable parameters ``cls`` steps, those AdamW steps beside it, the split in words)."""
    held = [
        (name, lay, slot) for name, lays in units.items() for lay in lays if lay.requires_grad for slot in lay.slots
    ]
    if not issubclass(cls, torch.optim.Muon):
        return [(lay, slot) for _, lay, slot in held], [], f"{cls.__name__} steps every trainable parameter"
    whole = [(lay, slot) for name, lay, slot in held if name != "root" and len(slot.shape) >= 2]
    rest = [(lay, slot) for name, lay, slot in held if not (name != "root" and len(slot.shape) >= 2)]
    words = (
        f"Muon steps the parameters of 2+ dimensions inside units other than the root ({len(whole)},"
        f" {_numel(whole):,} elements), AdamW the rest ({len(rest)}: embeddings, head, norms, biases;"
        f" {_numel(rest):,} elements)"
    )
    if not whole:
        words += (
            ". HINT: no unit but the root holds a matrix; unit_bucket_params=0 (or unit_classes) makes blocks units"
        )
    return whole, rest, words


def _numel(held: list[Held]) -> int:
    return sum(slot.numel for _, slot in held)


def plan_whole_model(
    units: Units, stage: Stage, policy: PrecisionPolicy, world_size: int, group: int, cls: type[Optimizer]
) -> WholePlan:
    """``cls`` on a real layout (``units`` at shard group size ``group``) over ``world_size`` ranks."""
    whole, rest, words = recipe(cls, units)
    owners = assign_owners([(slot.name, slot.numel) for _, slot in whole], world_size)
    owned_params, owned_numel, state = ([0] * world_size for _ in range(3))
    by_dtype: dict[torch.dtype, list[Owned]] = {}
    for lay, slot in whole:
        owner = owners[slot.name]
        travel = stage is Stage.PARAMETERS or policy.compute_for(lay.dtype) != lay.dtype
        by_dtype.setdefault(lay.dtype, []).append(Owned(slot.name, slot.shape, owner, pieces_of(lay, slot), travel))
        owned_params[owner] += 1
        owned_numel[owner] += slot.numel
        state[owner] += whole_state_bytes(cls, slot.shape, lay.dtype.itemsize)
    sent = {key: [0] * world_size for key in ("gather", "return", "across")}
    for dtype, entries in by_dtype.items():
        for key, per_rank in sent_by_rank(entries, Geometry(world_size, group)).items():
            for rank, numel in enumerate(per_rank):
                sent[key][rank] += numel * dtype.itemsize
    elementwise = [_elementwise_state(rest, position) for position in range(group)]
    return WholePlan(
        cls.__name__, words, len(whole), _numel(whole), 2 * len(by_dtype) if world_size > 1 else 0,
        owned_params, owned_numel, state, [elementwise[r % group] for r in range(world_size)],
        sent["gather"], sent["return"], sent["across"],
    )  # fmt: skip


def _elementwise_state(rest: list[Held], position: int) -> float:
    """AdamW's state at shard ``position``: its moments of each parameter's slice there, a step counter each."""
    shape = OptimizerShape.named(BESIDE_MUON)
    total = 0
    for lay, slot in rest:
        lo, hi = lay.slot_in_shard(slot, position)
        total += (hi - lo) * shape.per_element * lay.dtype.itemsize + shape.scalar_bytes
    return total


def plan_whole_params(
    params: float, world_size: int, group: int, cls: type[Optimizer], itemsize: int, values_travel: bool
) -> WholePlan:
    """``cls`` on ``params`` parameters of no known shape: the 1/W ideal, pieces of 1/G of each parameter."""
    w, g, groups = world_size, group, world_size // group
    factor = 2 if values_travel else 1
    words = (
        f"{cls.__name__} steps every parameter (a count has no shapes: --model for the usual recipe, AdamW beside it)"
        if issubclass(cls, torch.optim.Muon)
        else f"{cls.__name__}: every parameter taken as a vector (its whole second moment), an upper bound:"
        " matrices keep row and column statistics only (--model for the real figure)"
    )
    total = whole_state_bytes(cls, torch.Size([int(params)]), itemsize)

    def each(value: float) -> list[float]:
        return [value] * w

    return WholePlan(
        cls.__name__, words, 0, params, 2 if w > 1 else 0, each(0), each(params / w), each(total / w), each(0),
        each(params * (g - 1) / g * factor / w * itemsize),  # every holder but the owner sends its 1/G
        each(params * (w - 1) / g / w * itemsize),  # the owner sends each of the W - 1 other holders its 1/G
        each(params * (groups - 1) / w * itemsize),  # of which the other groups' G pieces each
    )  # fmt: skip
