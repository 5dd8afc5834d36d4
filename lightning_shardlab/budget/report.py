"""One rank's budget report: what ``ShardLabBudget`` measured over the steps, beside what the layout predicts.

``Run`` is what the budget reads of a run, whichever front door started it (a Trainer, or a Fabric loop
through ``budget.watch``). ``rank_report`` assembles this rank's figures into the plain dict every rank
sends to rank 0 at the end (and that ``shardlab_budget.json`` holds): memory by category measured and
predicted, the gathered peak, the units as they ran, communication per step by kind, by group and by call,
the offload tiers, what whole-tensor optimizers' owners hold (budget/predicted/whole_tensor.py), and the activations
saved for backward by unit (budget/measured/activations.py).
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES
from lightning_shardlab.budget.measured.tiers import offload_of, tier_report
from lightning_shardlab.budget.predicted.engine_schedule import Schedule, gathered_peak
from lightning_shardlab.budget.predicted.whole_tensor import state_bytes_predicted, whole_tensor_report
from lightning_shardlab.budget.predicted.zero_table import (
    OptimizerShape,
    predict_memory,
    predict_traffic,
)
from lightning_shardlab.comm.packing import packing_for
from lightning_shardlab.core.config import Accumulation
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.sharding.reduce_sample import EXACT_LABEL
from lightning_shardlab.sharding.sharded_model import ShardedModel

Traffic = dict[tuple[str, str, str], tuple[float, float, float]]  # (scope, kind, label) -> calls, bytes, seconds


def process_peak_bytes(device: torch.device) -> int:
    """The allocator's peak on a GPU; the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Run:
    """What the budget reads of a run, from either front door."""

    sharded: ShardedModel
    optimizers: list[Any]
    step: int  # optimizer steps so far
    log_every: int
    logger: Any  # has log_metrics(metrics, step), or None
    rank: int
    precision: str
    micro_batches: int  # per optimizer step
    directory: Callable[[], Path]  # a Trainer's log_dir is a collective: asked for only at the end

    @staticmethod
    def of_trainer(trainer: L.Trainer) -> Run | None:
        sharded = sharded_model_of(trainer)
        if sharded is None:
            return None
        return Run(
            sharded, trainer.optimizers, trainer.global_step, max(trainer.log_every_n_steps, 1), trainer.logger,
            trainer.global_rank, str(trainer.precision), trainer.accumulate_grad_batches,
            lambda: Path(trainer.log_dir or trainer.default_root_dir),
        )  # fmt: skip


@dataclass
class Measured:
    """What the callback measured over the steps it reports."""

    last: dict[str, float]  # the latest step's memory by category and gathered peak
    training: Traffic  # the collectives of the training steps (validation left out)
    step_seconds: float  # all steps together
    steps: int
    storage_io: list[float]  # bytes read, bytes written, seconds in offloaded steps (all steps together)
    activations: dict[str, Any]  # saved for backward at the peak forward, by unit (budget/measured/activations.py)
    # the first steady step's peak of tensor memory by phase (budget/measured/step_peak.py)
    step_peak: dict[str, dict[str, Any]]


def rank_report(run: Run, measured: Measured) -> dict[str, Any]:
    """This rank's figures, measured beside predicted."""
    sharded, steps = run.sharded, measured.steps
    layouts = sharded.trained_layouts()  # a backbone unfrozen mid-run holds gradients and state now
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}  # as they ran
    optimizer = OptimizerShape.of(run.optimizers[0]) if run.optimizers else None
    mesh = sharded.mesh
    reshard = mesh.reshard.world_size if mesh.regrouped else None
    traffic = predict_traffic(
        units,
        sharded.config.stage,
        sharded.policy,
        run.micro_batches,
        sharded.config.accumulation is Accumulation.REDUCE,
        sharded.config.reshard_after_forward,
        replicas=mesh.replica.world_size,
        reshard_size=reshard,
        gather_packing=packing_for(sharded.config.gather_dtype, sharded.config.quant_block_size),
        reduce_packing=packing_for(sharded.config.reduce_dtype, sharded.config.quant_block_size),
    )
    whole = whole_tensor_report(sharded, run.optimizers, run.step)
    if whole["optimizers"]:
        traffic = traffic.with_exchanges(whole["all_to_all_calls"], whole["all_to_all_bytes"])
    memory_predicted = predict_memory(
        layouts,
        sharded.config.stage,
        sharded.policy,
        mesh.shard.rank,
        optimizer,
        offload_of(sharded),
        error_feedback=sharded.config.reduce_dtype == "int8",
    )
    if whole["optimizers"]:  # each parameter's state by the optimizer that holds it
        memory_predicted["optimizer_state"] = state_bytes_predicted(sharded, run.optimizers)
    comm, by_scope, by_unit = per_step(measured.training, steps)
    step_seconds = measured.step_seconds / steps
    return {
        "rank": sharded.comm.rank,
        "world_size": sharded.comm.world_size,
        "stage": int(sharded.config.stage),
        "precision": run.precision,
        "optimizer_steps": steps,
        "units": {name: sum(lay.numel for lay in lays) for name, lays in units.items()},  # parameters, as ran
        "unit_policy": unit_policy(sharded),
        "reshard_after_forward": sharded.config.reshard_after_forward,
        "memory_measured": {k: measured.last[k] for k in (*MEMORY_CATEGORIES, "gathered_peak")},
        "memory_predicted": {
            **memory_predicted,
            "gathered_peak": gathered_peak(units, sharded.policy, Schedule.of(sharded.config), reshard),
        },
        "process_peak_bytes": process_peak_bytes(sharded.comm.device),
        "comm_per_step": comm,
        "comm_per_step_by_scope": by_scope,
        "comm_per_step_by_unit": by_unit,
        "comm_predicted_per_step": vars(traffic),
        "step_seconds": step_seconds,
        "comm_share_of_step": sum(c["seconds"] for c in comm.values()) / max(step_seconds, 1e-12),
        "whole_tensor": whole["optimizers"],
        "activations_measured": measured.activations,
        "step_peak_measured": measured.step_peak,
        **tier_report(sharded, run.optimizers, optimizer),
        "storage_io_per_step": dict(
            zip(("read", "written", "offload_seconds"), (v / steps for v in measured.storage_io))
        ),
    }


def unit_policy(sharded: ShardedModel) -> str:
    """Which option made the units: the user's classes, one per block, or buckets of blocks."""
    config = sharded.config
    if config.unit_classes:
        return "unit_classes=[" + ", ".join(cls.__name__ for cls in config.unit_classes) + "]"
    if not config.unit_bucket_params:
        return "unit_bucket_params=0 (a unit per repeated block)"
    return f"unit_bucket_params={config.unit_bucket_params:,} (repeated blocks merged into buckets of at least this)"


def per_step(training: Traffic, steps: int) -> tuple[dict, ...]:
    """The measured calls, bytes and seconds per step: by kind, by scope then kind, and by call ("kind
    label", with the scope first when it is not "world": one label may travel in several groups)."""

    def zero() -> dict[str, float]:
        return {"calls": 0.0, "bytes": 0.0, "seconds": 0.0}

    comm: dict[str, dict[str, float]] = defaultdict(zero)
    by_scope: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(zero))
    by_unit: dict[str, dict[str, float]] = defaultdict(zero)
    for (scope, kind, label), (count, nbytes, seconds) in training.items():
        if count == 0:
            continue
        name = f"{kind} {label}" if scope == "world" else f"{scope} {kind} {label}"
        entry_per_step = {"calls": count / steps, "bytes": nbytes / steps, "seconds": seconds / steps}
        sampled = label == EXACT_LABEL  # the budget's own extra call (reduce_sample.py): by call only, not predicted
        for entry in (by_unit[name],) if sampled else (comm[kind], by_scope[scope][kind], by_unit[name]):
            for k, v in entry_per_step.items():
                entry[k] += v
    return dict(comm), {scope: dict(kinds) for scope, kinds in by_scope.items()}, dict(by_unit)
