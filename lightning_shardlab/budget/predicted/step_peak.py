"""The step's peak predicted for the run itself, beside the one measured (budget/measured/step_peak.py).

At the first training batch, that batch (made fake: only its shapes and dtypes matter) runs through the module's
meta copy (budget/predicted/first_batch.py) on the engine's schedule (budget/predicted/step_timeline.py),
each unit's bytes read from the run's own layouts and, on gloo, its wire's receive rooms. The peak is the model
state the layout keeps on the device + the busiest moment of that timeline or of the optimizer's step
(budget/predicted/optimizer_peak.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shardlab.budget.predicted.engine_schedule import UnitBytes, no_rooms
from lightning_shardlab.budget.predicted.fake_step import STEPS, fake_like
from lightning_shardlab.budget.predicted.step_timeline import PlannedPeak, StepTimeline, step_timeline
from lightning_shardlab.sharding.sharded_model import ShardedModel


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
