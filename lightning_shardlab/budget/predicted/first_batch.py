"""The run's first batch traced: what the budget predicts its activations, its work and its step's peak from.

``ShardLabBudget`` sets the measured saved-for-backward bytes (budget/measured/activations.py), time and step's peak
(budget/measured/step_peak.py) beside predictions made without running the model: before the strategy shards the
module, ``meta_clone`` copies it with every tensor on the meta device (no data copied, none of the engine's hooks); at
the first training batch, that batch (made fake) goes once through the clone's step (forward_trace.py) and once
through its forward and backward on the engine's schedule (step_timeline.py), each unit's bytes read from the run's
own layouts and, on gloo, its wire's receive rooms. The peak is the model state the layout keeps on the device + the
busiest moment of that timeline or of the optimizer's step (optimizer_peak.py). Units and checkpointed modules come
from the run's own options, so prediction and measurement count the same tensors the same way. A model built in
``configure_model`` has no layers yet when the clone is taken, and a manual-optimisation step is not run: where
nothing traces, the prediction says why, in full (``error``) and in a few words (``why``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_shardlab.budget.predicted.compute_trace import ComputeTrace
from lightning_shardlab.budget.predicted.engine_schedule import UnitBytes, no_rooms
from lightning_shardlab.budget.predicted.fake_step import STEPS, fake_like
from lightning_shardlab.budget.predicted.forward_trace import ForwardTrace, trace_forward
from lightning_shardlab.budget.predicted.step_stand_ins import TrainerView, in_words
from lightning_shardlab.budget.predicted.step_timeline import PlannedPeak, StepTimeline, step_timeline
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding import checkpointing
from lightning_shardlab.sharding.hooks import installed_by_engine
from lightning_shardlab.sharding.sharded_model import ShardedModel


def meta_clone(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (nothing of their data is read or
    copied), as its user wrote it: without the engine's hooks and activation checkpointing when it was sharded
    already (validated, generated from or fitted before), and with a read-only view of its trainer
    (budget/predicted/step_stand_ins.py) in place of the trainer it is attached to (Fabric: none)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    fabric = getattr(module, "_fabric", None)
    if fabric is not None:
        memo[id(fabric)] = None
    for sub in module.modules():  # the live engine's hooks are not copied (they hold the ShardedModel): dropped below
        for hook in [*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()]:
            if installed_by_engine(hook):
                memo[id(hook)] = hook
    clone = copy.deepcopy(module, memo)
    for sub in clone.modules():
        for table in (sub._forward_pre_hooks, sub._forward_hooks):
            for key in [k for k, hook in table.items() if installed_by_engine(hook)]:
                del table[key]
    checkpointing.undo(clone, [name for name, _ in clone.named_modules()])
    for original, copied in zip(module.modules(), clone.modules()):  # a LightningModule's copy drops its trainer
        trainer = original.__dict__.get("_trainer")
        if trainer is not None:
            copied.__dict__["_trainer"] = TrainerView(trainer)
    return clone


def predict_first_batch(
    clone: nn.Module, batch: Any, config: ShardLabConfig, precision: str
) -> tuple[dict[str, Any], ComputeTrace]:
    """``clone``'s forward on a batch shaped like ``batch``, by the run's units, traced once (forward_trace.py): (the
    saved-for-backward bytes by unit, as the run keeps them, its checkpointed modules keeping only their inputs; the
    work of one micro-batch by unit, as the run does it, its checkpointed modules recomputed or not). When the batch
    does not trace, each says why, in full (``error``) and in a few words for the tables (``why``)."""
    first = next((t.shape for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), torch.Size())
    shape = (first[0] if len(first) > 0 else 1, first[1] if len(first) > 1 else 1)
    try:
        traced = trace_forward(clone, *shape, precision, config=config, make_inputs=lambda *_: fake_like(batch))
    except (ValueError, RuntimeError, TypeError) as err:
        failed = {"error": f"{type(err).__name__}: {err}", "why": getattr(err, "why", None) or in_words(err)}
        return dict(failed), ComputeTrace(**failed)
    checkpointing = bool(config.activation_checkpointing)
    return _activations(traced, checkpointing), traced.work.checkpointed(checkpointing)


def _activations(traced: ForwardTrace, checkpointing: bool) -> dict[str, Any]:
    trace = traced.activations
    by_unit = trace.checkpointed_by_unit if checkpointing else trace.by_unit
    return {
        "by_unit": {name: nbytes for name, nbytes in by_unit.items() if nbytes or name == "root"},
        "total": trace.saved(checkpointing),
        "recompute_peak": trace.recompute_peak if checkpointing else 0,
        "seconds": trace.seconds,
        "step": trace.step,  # what ran: "training_step" or "forward"
    }


def unit_bytes(sharded: ShardedModel) -> dict[str, UnitBytes]:
    """Each unit's bytes for the timeline, from its real layouts; receive rooms from the wires of the shard group and,
    with ``reshard_after_forward=k``, of the reshard group."""
    mesh = sharded.mesh
    rooms, regroup_rooms = (c.wire.receive_room if c.wire is not None else no_rooms for c in (mesh.shard, mesh.reshard))
    k = mesh.reshard.world_size if mesh.regrouped else None
    stage, policy = sharded.config.stage, sharded.policy
    return {
        unit.name: UnitBytes.of([fp.layout for fp in unit.flat_params], stage, policy, rooms, k, regroup_rooms)
        for unit in sharded.units
    }


def timeline_for_batch(
    clone: nn.Module, batch: Any, sharded: ShardedModel, precision: str, step: str
) -> StepTimeline | dict[str, str]:
    """``clone``'s step on a batch shaped like ``batch`` (``step``: what the activation trace ran, "training_step"
    or "forward"), on ``sharded``'s schedule; ``{"error": why}`` when it does not run."""
    try:
        return step_timeline(
            clone, sharded.config, unit_bytes(sharded), lambda: fake_like(batch), STEPS[step], precision
        )
    except Exception as err:  # noqa: BLE001 - a prediction says why it is missing; it never stops the run
        return {"error": f"{type(err).__name__}: {err}"}


def predict_step_peak(
    report: dict[str, Any],
    timeline: StepTimeline | dict[str, str] | None,
    optimizer: int | dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """The predicted peak: the layout's device state + the busiest moment of the timeline (forward, backward) and of
    the optimizer step (``optimizer``: its bytes beyond the state, budget/predicted/optimizer_peak.py), with that
    moment's parts and each phase's; ``{"error": why}`` or None when there is no timeline."""
    if not isinstance(timeline, StepTimeline):
        return timeline
    state = int(sum(report["locations_predicted"]["device"].values()))
    stepped = optimizer if isinstance(optimizer, int) else None
    moment, moments = timeline.busiest(stepped, "the optimizer's step, then the refresh")
    return {
        **PlannedPeak.at(state, moment).fields(),
        "by_phase": {name: state + m.total for name, m in moments.items()},
        "optimizer_error": optimizer.get("error") if isinstance(optimizer, dict) else None,
        "seconds": timeline.seconds,
    }
