"""The time predicted for a run: its own layout, schedule and first batch, at the end of fit (``ShardLabBudget``).

``time_predicted_for_run`` reads the run's units in their forward order, their layouts, its mesh, options and
optimizer's class, and plays one optimizer step (step_time.py) on the first batch's work traced through the budget's
meta copy (forward_trace.py). It adds no collective and reads no clock of the run: the link is given or measured once
per process by two gloo ranks of its own (a GPU run takes the NVLink preset), the rate given or measured once per
process on the run's device (compute_rate.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_shardlab.budget.measured.local_link import measure_local_link
from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, measure_rate, sharing_cores
from lightning_shardlab.budget.predicted.compute_trace import (
    ComputeTrace,
    Work,
    optimizer_work,
)
from lightning_shardlab.budget.predicted.engine_cost import with_engine_cost
from lightning_shardlab.budget.predicted.step_time import basis, predict_step_time
from lightning_shardlab.budget.predicted.zero_table import INTERCONNECTS, Interconnect, Links
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.sharded_model import ShardedModel


@functools.cache
def local_link() -> Interconnect:
    """This machine's link between two gloo ranks (comm/link_probe.py), measured once per process."""
    return measure_local_link()


def default_link(device: torch.device) -> Interconnect:
    """A CPU run's link: measured here (two gloo ranks, once per process); a GPU run's: the NVLink preset."""
    return local_link() if device.type == "cpu" else INTERCONNECTS["nvlink"]


def run_optimizer_work(
    sharded: ShardedModel, optimizers: list[Optimizer] | None, layouts: list[FlatParamLayout]
) -> tuple[Work, str]:
    """One optimizer step of this rank (the run's first optimizer's class and options, else AdamW), with the
    precision copies around it; and the class's name."""
    cls, options = torch.optim.AdamW, {}
    first = optimizers[0] if optimizers else None
    if first is not None and not getattr(first, "_shardlab_whole", False):  # a whole-tensor one: AdamW's bytes
        known = [c for c in type(first).__mro__ if c.__module__.startswith("torch.optim")]  # under Chunked<Class>
        cls = next((c for c in known if c is not Optimizer), torch.optim.AdamW)
        group = first.param_groups[0] if first.param_groups else {}
        options = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
    if not options.get("fused"):
        options["foreach"] = sharded.comm.device.type == "cuda"  # torch's default path on each device
    rank, policy = sharded.mesh.shard.rank, sharded.policy
    try:
        work = optimizer_work(cls, options, layouts, policy, rank)
    except Exception:  # noqa: BLE001 - options the fakes refuse (capturable, fused on another device): AdamW's
        cls, options = torch.optim.AdamW, {"foreach": sharded.comm.device.type == "cuda"}
        work = optimizer_work(cls, options, layouts, policy, rank)
    return work, cls.__name__


def run_rate(sharded: ShardedModel, compute: ComputeTrace | None) -> ComputeRate:
    """The compute rate measured on the run's device in its compute dtype, on the traced model's heaviest matmuls
    (budget/predicted/compute_rate.py's ``measure_rate``, cached per process), with the engine's own work per unit at
    the run's stage (budget/predicted/engine_cost.py): what this process sustains while nothing else runs beside it,
    so the ranks on one machine take turns to call it (budget/callback.py)."""
    layouts = [fp.layout for u in sharded.forward_order for fp in u.flat_params]
    dtype = sharded.policy.compute_dtype or (layouts[0].dtype if layouts else torch.float32)
    return with_engine_cost(measure_rate(sharded.comm.device, dtype, compute), sharded.config.stage)


def time_predicted_for_run(
    sharded: ShardedModel,
    compute: ComputeTrace | None,
    micro_batches: int,
    precision: str,
    *,
    link: Interconnect | None = None,
    inter: Interconnect | None = None,
    rate: ComputeRate | None = None,
    optimizers: list[Optimizer] | None = None,
    data_seconds: float = 0.0,
    ranks_here: int = 1,
    link_share: float = 1.0,
) -> dict[str, Any]:
    """This rank's seconds per optimizer step predicted (``predict_step_time``) for the run: ``compute`` its first
    batch's work (first_batch.py's ``predict_first_batch``); ``link`` (default: ``default_link``; ``inter``
    across shard groups, default ``link``); ``rate`` (default: measured here, shared by the ``ranks_here`` ranks of
    this machine: ``sharing_cores``). ``{"error": why}`` when there is nothing to predict from. Adds no collective:
    call it on any rank, at any time."""
    if compute is None or compute.error:
        why = compute.error if compute is not None else "the first batch was not traced"
        short = f"the first batch did not trace: {compute.why}" if compute is not None else "no batch was traced"
        return {
            "error": f"[rank {sharded.comm.rank}] no compute to time: {why}. HINT: see activations_predicted.",
            "why": short,
        }
    device, mesh = sharded.comm.device, sharded.mesh
    alone = mesh.shard.world_size == 1 and mesh.replica.world_size == 1  # nothing crosses a link
    try:
        link = link or (Interconnect("none: one rank", float("inf"), 0.0) if alone else default_link(device))
    except Exception as err:  # noqa: BLE001 - a prediction says why it is missing; it never stops the run
        return {
            "error": f"[rank {sharded.comm.rank}] the link probe failed: {err}. HINT: pass link=INTERCONNECTS[...]."
        }
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}
    layouts = [lay for lays in units.values() for lay in lays]
    rate = rate or sharing_cores(run_rate(sharded, compute), ranks_here)
    links = Links.of_mesh(mesh, link, inter or link)
    work, name = run_optimizer_work(sharded, optimizers, layouts)
    out = predict_step_time(
        units, compute, rate, sharded.config, sharded.policy, links,
        micro_batches=micro_batches, optimizer=work, data_seconds=data_seconds, link_share=link_share,
    )  # fmt: skip
    out["basis"] = {**basis(rate, links, micro_batches, precision, name), "link_share": link_share}
    return out
