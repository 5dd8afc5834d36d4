"""The step's peak predicted for the run itself, beside the one measured (budget/step_peak.py).

The same arithmetic as ``shardlab plan``'s verdict (budget/fits.py, ``PlannedPeak``), on the run's own
figures: the model state its layout keeps on the device between steps and the gathered units at their peak
(budget/predict.py, budget/tiers.py), what its first batch saves for backward and, with activation
checkpointing, the largest recomputation (traced under fake tensors, budget/activation_prediction.py) — plus
what a plan made for NCCL has no reason to count: the receive rooms of the verified gloo wire live at the busiest
moment (``Wire.rooms_at_peak``: a reduce-scatter's room from each peer and an all-gather's scratch room).
"""

from __future__ import annotations

from typing import Any

from lightning_shardlab.budget.fits import PlannedPeak
from lightning_shardlab.sharding.sharded_model import ShardedModel


def receive_rooms(sharded: ShardedModel) -> int:
    """Bytes of receive room the shard group's wire keeps live at a step's busiest moment (0 without one)."""
    wire = sharded.mesh.shard.wire
    return wire.rooms_at_peak if wire is not None else 0


def predict_step_peak(report: dict[str, Any], rooms: int) -> dict[str, Any] | None:
    """``report``'s predicted peak (PlannedPeak's fields, its total and arithmetic); None when its activations
    were not traced (budget/activation_prediction.py says why)."""
    activations = report.get("activations_predicted") or {}
    if "total" not in activations:
        return None
    peak = PlannedPeak(
        model_state=float(sum(report["locations_predicted"]["device"].values())),
        gathered=float(report["memory_predicted"]["gathered_peak"]),
        activations=float(activations["total"]),
        recompute=float(activations.get("recompute_peak", 0)),
        transport=float(rooms),
    )
    return {**vars(peak), "total": peak.total, "arithmetic": peak.arithmetic()}
