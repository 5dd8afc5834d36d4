"""The engine's schedule on stand-in units: what ShardedModel (sharding/sharded_model.py) gathers, keeps, reduces and
waits for at each of its hooks, on units of bytes and seconds. One model serves the step's peak and its time:
step_timeline.py drives it by the very hooks the engine installs, under a fake step, and counts the bytes it holds;
step_time.py drives it in the units' order (``drive``) and lets its ``Clock`` play every call on the links; the
gathered units' peak of a run's report and of a plan is its most gathered at once (``gathered_peak``).

Per micro-batch (forward order = the units' order): at stage 3 the first unit's all-gather is launched as the step
begins and the root's waited for at once; at unit k's pre-forward its gather is waited for and unit k+1's launched
(``prefetch``: how many ahead); each unit but the one that runs forward last is resharded after it (none with
``reshard_after_forward=False``; with k, it keeps its group shards and gathers again in the reshard group). Backward
runs the units in reverse: each gathered again if it was resharded, the one before it prefetched; at its
post-backward (stages 2-3) the reduce-scatter in flight is waited for (``MAX_REDUCTIONS_IN_FLIGHT``; hybrid: its
all-reduce across replicas launched then) and its own launched. At the end of backward the units with no
post-backward and the root are reduced (stage 1: every unit, all in flight at once), then every reduction waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_shardlab.budget.measured.activations import ROOT
from lightning_shardlab.core.config import Accumulation, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.sharded_model import MAX_REDUCTIONS_IN_FLIGHT
from lightning_shardlab.sharding.unit import TrainingState

Rooms = Callable[[str, int], int]  # (collective, bytes sent to each peer) -> receive room held while it flies


def no_rooms(kind: str, payload: int) -> int:
    """NCCL (and a plan): collectives post no receive buffers of their own."""
    return 0


@dataclass(frozen=True)
class Schedule:
    """What decides the engine's order: the stage, resharding, accumulation, and how far gathers run ahead."""

    stage: Stage
    reshard_after_forward: bool | int = True
    defer: bool = False  # accumulation="defer": only the last micro-batch reduces
    prefetch: int = 1  # units gathered ahead (the engine: 1)

    @staticmethod
    def of(config: ShardLabConfig, prefetch: int = 1) -> Schedule:
        """The schedule a run with ``config`` follows."""
        defer = config.accumulation is Accumulation.DEFER
        return Schedule(config.stage, config.reshard_after_forward, defer, prefetch)


@dataclass(frozen=True)
class UnitBytes:
    """What the engine holds for one unit, from its flat parameters' layouts."""

    gathered: int = 0  # its full buffers while gathered (stage 3; at stages 1-2 they are model state)
    gathering: int = 0  # the receive rooms of its all-gathers while they fly
    reducing: int = 0  # its flat gradients, new grad shards and receive rooms while the reduce-scatters fly
    regrouped: int = 0  # reshard_after_forward=k: the group shards it keeps from its forward to its backward
    regathering: int = 0  # ... and the receive rooms of backward's all-gathers from them, in the reshard group
    laying_out: int = 0  # the gradients laid out in their own dtype, before the cast to the reduce dtype

    @staticmethod
    def of(
        layouts: list[FlatParamLayout],
        stage: Stage,
        policy: PrecisionPolicy,
        rooms: Rooms = no_rooms,
        reshard_size: int | None = None,
        reshard_rooms: Rooms = no_rooms,
    ) -> UnitBytes:
        gathered = gathering = reducing = regrouped = regathering = laying_out = 0
        for lay in layouts:
            compute = policy.compute_for(lay.dtype).itemsize
            if stage is Stage.PARAMETERS and lay.world_size > 1:
                gathered += lay.padded_numel * compute
                gathering += rooms("all_gather", lay.shard_numel * compute)
                if reshard_size:
                    regrouped += lay.padded_numel // reshard_size * compute
                    regathering += reshard_rooms("all_gather", lay.padded_numel // reshard_size * compute)
            if lay.requires_grad:
                reduce = (policy.reduce_dtype or lay.dtype).itemsize  # fp32 under mixed precision, unless asked
                reducing += (lay.padded_numel + lay.shard_numel) * reduce
                laying_out += lay.padded_numel * compute if reduce != compute else 0
                reducing += rooms("reduce_scatter", lay.shard_numel * reduce) if lay.world_size > 1 else 0
        return UnitBytes(gathered, gathering, reducing, regrouped, regathering, laying_out)


class Clock:
    """What the schedule tells a clock of the calls it makes (step_time.py's ``Played`` plays them on the links);
    counting bytes needs none."""

    def gather(self, unit: StandInUnit, backward: bool) -> None: ...
    def wait_gather(self, unit: StandInUnit) -> None: ...
    def reduce(self, unit: StandInUnit) -> None: ...
    def wait_reduce(self, unit: StandInUnit) -> None: ...  # and launch its all-reduce across replicas
    def wait_across(self, unit: StandInUnit) -> None: ...


class StandInUnit:
    """What sharding/hooks.py reads and writes on a unit (sharding/unit.py's ``Unit``), for a unit of bytes
    (``size``) and seconds (``times``: step_time.py's ``UnitTimes``)."""

    def __init__(self, name: str, modules: list[nn.Module], params: list[nn.Parameter], size: UnitBytes = UnitBytes(),
                 times: Any = None, trains: bool | None = None) -> None:  # fmt: skip
        self.name, self.modules, self.params, self.size, self.times = name, modules, params, size, times
        self.is_root = name == ROOT
        self.grad_flat_params = [p for p in params if p.requires_grad]
        self.trains = bool(self.grad_flat_params) if trains is None else trains
        self.training = TrainingState.IDLE
        self.forwarded = 0
        self.awaiting_post_backward = 0


class EngineStandIn:
    """ShardedModel's decisions on stand-in units, the root first: what is gathered, what flies, in what order."""

    def __init__(self, units: list[StandInUnit], plan: Schedule, sample: Callable[..., None] = lambda *_, **__: None,
                 clock: Clock | None = None, reduces: bool = True) -> None:  # fmt: skip
        self.units, self.plan, self.sample, self.reduces = units, plan, sample, reduces
        self.clock = clock or Clock()
        self.root = units[0]
        self.gathered: set[StandInUnit] = {self.root}  # held for the step
        self.gathering: set[StandInUnit] = set()  # prefetched, not waited yet
        self.regrouped: set[StandInUnit] = set()  # keeping group shards for backward (reshard_after_forward=k)
        self.last_order = units[1:]  # last step's forward order
        self.order: list[StandInUnit] = []
        self.in_flight: list[StandInUnit] = []  # reductions not waited yet
        self.rng_states: dict[StandInUnit, int] = {}  # checkpointed modules' RNG states, by unit, until backward
        self.laying_out = 0  # a unit's gradients laid out in their own dtype, while they are cast to the reduce dtype
        self.phase = "forward"
        self._prefetch(self.last_order[: plan.prefetch])
        if plan.stage is Stage.PARAMETERS:  # the root's gather, launched and waited for as the step begins
            self.clock.gather(self.root, False)
            self.clock.wait_gather(self.root)

    @property
    def gathered_bytes(self) -> int:
        return sum(u.size.gathered for u in self.gathered) + sum(u.size.regrouped for u in self.regrouped)

    @property
    def in_flight_bytes(self) -> int:
        gathering = sum(u.size.regathering if u in self.regrouped else u.size.gathering for u in self.gathering)
        return gathering + sum(u.size.reducing for u in self.in_flight) + self.laying_out

    def _prefetch(self, units: list[StandInUnit]) -> None:
        if self.plan.stage is Stage.PARAMETERS:
            for unit in units:
                if unit not in self.gathered:
                    self.gathered.add(unit)
                    self.gathering.add(unit)
                    self.clock.gather(unit, self.phase == "backward")

    def _unshard(self, unit: StandInUnit) -> None:
        self._prefetch([unit])
        self.sample(f"gathered {unit.name}")
        if unit in self.gathering:
            self.gathering.discard(unit)
            self.clock.wait_gather(unit)

    def _after(self, unit: StandInUnit, order: list[StandInUnit]) -> list[StandInUnit]:
        i = order.index(unit) if unit in order else len(order)
        return order[i + 1 : i + 1 + self.plan.prefetch]

    def pre_forward(self, unit: StandInUnit) -> None:
        if unit.is_root:
            return
        self._unshard(unit)
        self.order.append(unit)
        self._prefetch(self._after(unit, self.last_order))
        self.sample(f"pre_forward {unit.name}")

    def post_forward(self, unit: StandInUnit) -> None:
        last = self.last_order[-1] if self.last_order else None
        if not unit.is_root and self.plan.reshard_after_forward and unit is not last:
            self._reshard(unit, regroup=bool(unit.size.regrouped))

    def _reshard(self, unit: StandInUnit, regroup: bool = False) -> None:
        if self.plan.stage is Stage.PARAMETERS and unit is not self.root:
            self.gathered.discard(unit)
            self.gathering.discard(unit)
            (self.regrouped.add if regroup else self.regrouped.discard)(unit)

    def pre_backward(self, unit: StandInUnit) -> None:
        self.phase = "backward"
        self._unshard(unit)
        if not unit.is_root:
            self._prefetch(self._after(unit, self.order[::-1]))
        unit.training = TrainingState.BACKWARD
        self.sample(f"pre_backward {unit.name}")

    def post_backward(self, unit: StandInUnit) -> None:
        unit.awaiting_post_backward = 0
        if unit.training is not TrainingState.BACKWARD:
            return
        unit.training = TrainingState.GRADS_PENDING
        self.rng_states.pop(unit, None)  # its recomputations are done
        if unit.trains and self.plan.stage >= Stage.GRADIENTS and self.reduces:
            self._reduce(unit)
        self._reshard(unit)

    def _reduce(self, unit: StandInUnit) -> None:
        limit = len(self.units) if self.plan.stage is Stage.OPTIMIZER else MAX_REDUCTIONS_IN_FLIGHT
        while len(self.in_flight) >= limit:
            self.clock.wait_reduce(self.in_flight.pop(0))
        self.in_flight.append(unit)  # the flat gradient is laid out while the params' gradients still live
        self.clock.reduce(unit)
        self.laying_out = unit.size.laying_out
        self.sample(f"reduce-scatter {unit.name}")
        self.laying_out = 0
        for param in unit.params:
            param.grad = None
        unit.training = TrainingState.REDUCING

    def finish_backward(self) -> None:
        """The end of backward: units with no post-backward, then every pending reduction (the root's), waited."""
        for unit in reversed(self.units):
            if unit.training is TrainingState.BACKWARD:
                self.post_backward(unit)
        for unit in reversed(self.units):
            if unit.training is TrainingState.GRADS_PENDING and unit.trains and self.reduces:
                self._reduce(unit)
        for unit in self.units:
            if unit in self.in_flight:
                self.clock.wait_reduce(unit)
            self.clock.wait_across(unit)
        self.in_flight.clear()
        self.sample("end of backward")


def drive(engine: EngineStandIn, compute: Callable[[StandInUnit, str], None] = lambda unit, part: None) -> None:
    """One micro-batch through the engine's hooks in the units' order, ``compute(unit, part)`` where each unit
    computes: the root's ``lead`` (its forward before the units) and the rest of its ``forward`` after them; in
    backward the root's first, its ``lead backward`` last."""
    root, units = engine.root, engine.units[1:]
    compute(root, "lead")
    for unit in units:
        engine.pre_forward(unit)
        compute(unit, "forward")
        engine.post_forward(unit)
    compute(root, "forward")
    engine.pre_backward(root)
    compute(root, "backward")
    for unit in units[::-1]:
        engine.pre_backward(unit)
        compute(unit, "backward")
        engine.post_backward(unit)
    compute(root, "lead backward")
    engine.finish_backward()


def gathered_peak(
    units: dict[str, list[FlatParamLayout]],
    policy: PrecisionPolicy,
    plan: Schedule,
    reshard_size: int | None = None,
) -> int:
    """Stage 3: the most bytes of full buffers (and, with ``reshard_size`` k, of group shards kept for backward) the
    engine holds at once in a micro-batch, the root's included: the schedule driven in ``units``' order (the root
    first, then in forward order). 0 at stages 1-2, whose full buffers are model state."""
    held = [0]

    def sample(*_: Any, **__: Any) -> None:
        held.append(engine.gathered_bytes)

    sizes = {name: UnitBytes.of(lays, plan.stage, policy, reshard_size=reshard_size) for name, lays in units.items()}
    engine = EngineStandIn([StandInUnit(n, [], [], size, trains=False) for n, size in sizes.items()], plan, sample)
    drive(engine)
    return max(held)
