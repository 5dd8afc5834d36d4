"""Where the time goes, predicted: seconds per optimizer step, from the layout, the traced work and the links.

The step is played on the engine's clocks (clocks.py: one compute stream, each link a first-in-first-out queue, as a
process group runs its collectives in order; at ``link_share`` of its speed while compute runs), in the engine's
order (sharding/sharded_model.py):

    step        = forward + backward + optimizer + data + comm_exposed + waiting_for_ranks
    comm_hidden = each collective's seconds in flight before its wait, summed   (in flight while computing)

and by collective kind its seconds on the wire, ``exposed``, ``hidden`` and ``in_flight`` (launch to end, queued
behind others included: what a clock at the engine's seams sees, budget/measured/). The played step is kept as the
timeline picture's events (``timeline``), so one model serves the run's prediction, the plan and the picture
(budget/timeline_picture.py). How each part is priced (docs/budget.md, "The time per step"): a collective at its
link's ring bound, one call per flat parameter sized as ``predict_traffic`` counts it, gathers and reduce-scatters
inside the shard group, all-reduces across replicas, each call's cost to its rank paid as compute where compute runs
while it flies, else in its wait (clocks.py); compute from each unit's traced work (forward_trace.py) at a rate
(compute_rate.py), the root's ``lead`` (embeddings) before the units and its backward last; the optimizer's traced
kernels at memory bandwidth; ``data`` 0 unless given, ``waiting_for_ranks`` 0 (the ranks are taken to be equal).

The schedule is the engine's (engine_schedule.py: the same stand-in the step's peak is counted on, its hooks called
in the units' order), once per micro-batch (each gathers again; with ``accumulation="defer"`` only the last
reduces); after the optimizer step, stages 1-2 all-gather every trained flat parameter from the new shards
(``refresh``, waited for at once).

What it leaves out: the small collectives (unused-parameter agreement, clipping's norm, metrics), the all-to-alls of
whole-tensor optimizers, offload's host transfers, kernels slowing each other beside a collective (memory bandwidth,
a GPU's multiprocessors), and ranks that differ (``waiting_for_ranks`` measured, never predicted). Backward as 2 x
the FLOPs undercounts attention's (2.5 x) and counts an embedding's as memory-bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_shardlab.budget.measured.activations import ROOT
from lightning_shardlab.budget.predicted.clocks import Timeline
from lightning_shardlab.budget.predicted.compute_rate import ComputeRate
from lightning_shardlab.budget.predicted.compute_trace import (
    ComputeTrace,
    UnitWork,
    Work,
)
from lightning_shardlab.budget.predicted.engine_schedule import Clock, EngineStandIn, Schedule, StandInUnit, drive
from lightning_shardlab.budget.predicted.zero_table import Links
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout

PARTS = ("forward", "backward", "optimizer", "data", "comm_exposed", "waiting_for_ranks")  # they add up to the step
INTRA, INTER = "intra", "inter"  # the link inside shard groups, the link across them


@dataclass(frozen=True)
class UnitTimes:
    """One unit's seconds per micro-batch: its compute, and its collectives on the wire (0: none)."""

    name: str
    forward: float = 0.0
    backward: float = 0.0
    lead_forward: float = 0.0  # the root: its forward before the first unit (its backward at the end: lead_backward)
    gather: float = 0.0  # stage 3: all-gather in the shard group
    regather: float = 0.0  # stage 3: backward all-gather (in the reshard group with reshard_after_forward=k)
    reduce: float = 0.0  # reduce-scatter of its gradients
    across: float = 0.0  # hybrid: all-reduce of its gradient shards across the replicas
    refresh: float = 0.0  # stages 1-2: all-gather after the optimizer step
    launch: float = 0.0  # host seconds to launch one of its collectives inside the shard group (one call per flat
    launch_across: float = 0.0  # parameter), and one across groups: paid as compute, or in the call's wait
    lead_backward: float = 0.0  # the root: the backward of its lead forward, the last of the step's backward
    beside: float = 0.0  # seconds more one of its collectives inside the shard group (the backward gathers': in the
    beside_regather: float = 0.0  # reshard group) and one across groups wait at a busy rank's latency, if their
    beside_across: float = 0.0  # rank computes while they are pending (clocks.py)


class Played(Clock):
    """The schedule's calls (engine_schedule.py) on the links of ``line``, each unit's seconds from its ``UnitTimes``,
    each call's cost to the host paid as the clocks pay it."""

    def __init__(self, line: Timeline) -> None:
        self.line = line

    def gather(self, unit: StandInUnit, backward: bool) -> None:
        t = unit.times
        seconds, beside = (t.regather, t.beside_regather) if backward else (t.gather, t.beside)
        self.line.launch(("gather", t.name), "all_gather", INTRA, seconds, t.launch, beside)

    def wait_gather(self, unit: StandInUnit) -> None:
        self.line.wait(("gather", unit.name))

    def reduce(self, unit: StandInUnit) -> None:
        t = unit.times
        self.line.launch(("reduce", t.name), "reduce_scatter", INTRA, t.reduce, t.launch, t.beside)

    def wait_reduce(self, unit: StandInUnit) -> None:
        t = unit.times
        self.line.wait(("reduce", t.name))
        self.line.launch(("across", t.name), "all_reduce", INTER, t.across, t.launch_across, t.beside_across)

    def wait_across(self, unit: StandInUnit) -> None:
        self.line.wait(("across", unit.name))


def _micro_batch(line: Timeline, engine: EngineStandIn) -> None:
    """One micro-batch's forward and backward (``drive``), each unit computing its seconds where the engine's hooks
    leave it: the root's lead forward before the units and the rest after them, its backward first and its lead's
    last."""

    def compute(unit: StandInUnit, part: str) -> None:
        t = unit.times  # the root's lead parts apart (0 for the other units)
        line.phase = "backward" if part.endswith("backward") else "forward"
        seconds = {"lead": t.lead_forward, "forward": t.forward - t.lead_forward,
                   "backward": t.backward - t.lead_backward, "lead backward": t.lead_backward}  # fmt: skip
        line.compute(seconds[part], line.phase, unit.name)

    drive(engine, compute)


def play(
    root: UnitTimes,
    units: list[UnitTimes],
    plan: Schedule,
    micro_batches: int = 1,
    optimizer: float = 0.0,
    data: float = 0.0,
    link_share: float = 1.0,
) -> Timeline:
    """One optimizer step on the engine's schedule: data, each micro-batch's forward and backward, the optimizer,
    and at stages 1-2 the refresh of every resident unit (launched together, waited for); the links at
    ``link_share`` of their speed while compute runs (``Timeline``)."""
    line = Timeline(link_share)
    line.compute(data, "data", "data")
    for i in range(micro_batches):
        line.phase = "forward"
        stand_ins = [StandInUnit(t.name, [], [], times=t, trains=bool(t.reduce or t.across)) for t in [root, *units]]
        reduces = not plan.defer or i == micro_batches - 1
        _micro_batch(line, EngineStandIn(stand_ins, plan, clock=Played(line), reduces=reduces))
    line.phase = "optimizer"
    line.compute(optimizer, "optimizer", "optimizer")
    if plan.stage is not Stage.PARAMETERS:
        for unit in [root, *units]:
            line.launch(("refresh", unit.name), "all_gather", INTRA, unit.refresh, unit.launch, unit.beside)
        for unit in [root, *units]:
            line.wait(("refresh", unit.name))
    return line


# ---- from layouts and work ----


def unit_times(
    name: str, layouts: list[FlatParamLayout], seconds: tuple[float, ...], policy: PrecisionPolicy,
    stage: Stage, links: Links,
) -> UnitTimes:  # fmt: skip
    """One unit's collectives from its flat parameters' layouts (one call each), beside its compute ``seconds``
    (forward, backward, root's lead forward, and its backward) per micro-batch."""
    gather = regather = reduce = across = refresh = 0.0
    calls = sum(1 for lay in layouts if lay.world_size > 1)
    calls_across = sum(1 for lay in layouts if lay.requires_grad) if links.replicas > 1 else 0
    for lay in layouts:
        c, r = policy.compute_for(lay.dtype).itemsize, (policy.reduce_dtype or lay.dtype).itemsize
        n = lay.world_size
        if n > 1:
            ring = links.intra.ring_seconds(lay.padded_numel * c, n)
            if stage is Stage.PARAMETERS:
                gather += ring
                regather += links.intra.ring_seconds(lay.padded_numel * c, links.reshard_size or n)
            refresh += ring if stage is not Stage.PARAMETERS and lay.requires_grad else 0.0
            reduce += links.intra.ring_seconds(lay.padded_numel * r, n) if lay.requires_grad else 0.0
        if lay.requires_grad and links.replicas > 1:
            across += links.inter.all_reduce_seconds(lay.shard_numel * r, links.replicas)
    forward, backward, lead, lead_backward = seconds
    launch, launch_across = calls * links.intra.launch, calls_across * links.inter.launch
    n = max((lay.world_size for lay in layouts), default=1)
    beside = links.intra.busy_extra(n, calls), links.intra.busy_extra(links.reshard_size or n, calls)
    across_beside = links.inter.busy_extra(links.replicas, calls_across, all_reduce=True) if calls_across else 0.0
    return UnitTimes(
        name, forward, backward, lead, gather, regather, reduce, across, refresh, launch, launch_across, lead_backward,
        *beside, across_beside,
    )  # fmt: skip


def _compute_seconds(work: UnitWork | None, rate: ComputeRate, is_root: bool) -> tuple[float, ...]:
    """(forward, backward, lead forward, lead backward) seconds of one micro-batch of a unit's work, with the
    engine's own work for the unit (its hooks) and, the root's, for the step (``rate.engine``: engine_cost.py)."""
    work, engine = work or UnitWork(), rate.engine
    forward = rate.seconds(work.forward) + engine.unit_forward + (engine.step_forward if is_root else 0.0)
    backward = rate.seconds(work.backward) + engine.unit_backward + (engine.step_backward if is_root else 0.0)
    lead = (rate.seconds(work.lead), rate.seconds(work.lead.backward())) if is_root else (0.0, 0.0)
    return forward, backward, *lead


def _works(units: dict[str, list[FlatParamLayout]], compute: ComputeTrace) -> dict[str, UnitWork]:
    """The traced work by the layout's units; a traced unit the layout lacks (no parameters of its own) runs in
    the root, after the units."""
    works = {name: compute.by_unit.get(name, UnitWork()) for name in units}
    for name, work in compute.by_unit.items():
        if name not in units:
            root = works.get(ROOT, UnitWork())
            works[ROOT] = UnitWork(root.forward + work.forward, root.recompute + work.recompute, root.lead)
    return works


def predict_step_time(
    units: dict[str, list[FlatParamLayout]],
    compute: ComputeTrace,
    rate: ComputeRate,
    config: ShardLabConfig,
    policy: PrecisionPolicy,
    links: Links,
    *,
    micro_batches: int = 1,
    optimizer: Work | None = None,
    data_seconds: float = 0.0,
    prefetch: int = 1,
    link_share: float = 1.0,
) -> dict[str, Any]:
    """Seconds per optimizer step (the module's docstring): ``units`` the layouts of a shard group, the root first
    then in forward order; ``compute`` one micro-batch's work by unit; ``optimizer`` one step's work; ``link_share``
    the share of their speed the links keep while compute runs (compute_rate.py's ``link_share``)."""
    works, optimizer = _works(units, compute), optimizer or Work()
    times = [
        unit_times(name, lays, _compute_seconds(works[name], rate, name == ROOT), policy, config.stage, links)
        for name, lays in units.items()
    ]
    root, others = times[0], times[1:]
    plan = Schedule.of(config, prefetch)
    stepping = rate.seconds(optimizer, bare=True)  # its kernels dispatched outside modules and autograd
    line = play(root, others, plan, micro_batches, stepping, data_seconds, link_share)
    return _result(times, line, micro_batches, stepping, data_seconds)


def _result(
    times: list[UnitTimes], line: Timeline, micro_batches: int, optimizer: float, data: float
) -> dict[str, Any]:
    m = micro_batches
    launching = line.launching
    parts = {
        "forward": m * sum(t.forward for t in times) + launching.get("forward", 0.0),
        "backward": m * sum(t.backward for t in times) + launching.get("backward", 0.0),
        "optimizer": optimizer + launching.get("optimizer", 0.0),
        "data": data,
        "comm_exposed": sum(line.exposed.values(), 0.0),
        "waiting_for_ranks": 0.0,
    }
    return {
        "step": sum(parts[k] for k in PARTS),
        **parts,
        "comm_hidden": sum(line.hidden.values(), 0.0),
        "by_unit": {t.name: {"forward": m * t.forward, "backward": m * t.backward} for t in times},
        "by_collective": {kind: _kind(line, kind) for kind in line.wire},
        "timeline": {"step_seconds": line.now, "events": sorted(line.events, key=lambda e: e["start"])},
    }


def _kind(line: Timeline, kind: str) -> dict[str, float]:
    """One collective kind per step, as budget/measured/step_time.py counts it: on the wire, exposed, hidden (in
    flight before the waits), ``in_flight`` (hidden + exposed), and ``to_wait`` (launch to the end of its wait: what
    the seams see of a call whose works say they are done only when waited for, as gloo's point-to-point ones)."""
    return {
        "seconds": line.wire[kind],
        "exposed": line.exposed.get(kind, 0.0),
        "hidden": line.hidden.get(kind, 0.0),
        "in_flight": line.in_flight[kind],
        "to_wait": line.to_wait.get(kind, 0.0),
    }


def basis(rate: ComputeRate, links: Links, micro_batches: int, precision: str, optimizer: str) -> dict[str, Any]:
    """What a prediction was made from, to print beside it."""
    return {
        "rate": rate.name,
        "flops_per_second": rate.flops_per_second,
        "bytes_per_second": rate.bytes_per_second,
        "seconds_per_op": rate.seconds_per_op,
        "seconds_per_bare_op": rate.seconds_per_bare_op,
        "engine_seconds": dataclasses.asdict(rate.engine),
        "probe_seconds": rate.probe_seconds,
        "link": links.intra.name,
        "link_figures": dataclasses.asdict(links.intra),  # bytes/s, seconds per message, seconds to launch a call
        "inter": links.inter.name if links.replicas > 1 else None,
        "micro_batches": micro_batches,
        "precision": precision,
        "optimizer": optimizer,
    }
