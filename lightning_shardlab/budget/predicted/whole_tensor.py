"""The budget of whole-tensor optimizers (Muon, Adafactor): what each rank owns, the state it holds for it, and
what the owners' exchanges move per step, predicted from the owner plan (sharding/owners.py) and measured.

Optimizer state per owned parameter of shape (..., m, n), in the master's dtype:

    Muon        the momentum buffer, whole: m n elements
    Adafactor   matrices: row and column statistics, numel / n + numel / m elements, and a float32 step;
                vectors: a whole second moment and the step
    any other   the state of the elementwise class it derives from, whole (SGD with momentum: one buffer);
                a class of its own, whose state nothing tells before it steps: two moments and a step, as Adam's

Beside them, elementwise optimizers keep their state of each parameter's slice in this rank's shard.
``ShardLabBudget`` prints these figures per rank beside what it measured; budget/predicted/plan_whole.py predicts
them before the run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.sharding.optimizer import ELEMENTWISE, OptimizerShape, is_whole_tensor
from lightning_shardlab.sharding.owners import exchange_numel, gather_counts, return_counts
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
