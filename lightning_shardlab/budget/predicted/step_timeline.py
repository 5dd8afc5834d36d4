"""The step's peak, moment by moment: one micro-batch's forward and backward under fake tensors, on the engine's
own schedule.

Adding up a step's parts (state + gathered + activations) counts them as if all were live at once; they are not: the
logits are freed early in backward, a block's saved tensors go as its backward runs, the gathered units change from
unit to unit. So ``step_timeline`` runs the step and sums, after every op, what is live: **traced** storages not yet
freed (``LiveStorages``: batch, saved tensors, temporaries, gradients, recomputations), and what **the engine** holds
(engine_schedule.py's ``EngineStandIn``: gathered units, flat gradients whose reduce-scatter flies), driven by the
very hooks the engine installs (sharding/hooks.py). On gloo the wire's
receive rooms (``Wire.receive_room``) count from launch to wait; NCCL, and a plan, post none. torch's checkpoint keeps
a CPU RNG state per checkpointed module, added by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_shardlab.budget.measured.activations import ROOT
from lightning_shardlab.budget.predicted.engine_schedule import EngineStandIn, Schedule, StandInUnit, UnitBytes
from lightning_shardlab.budget.predicted.fake_step import computing, fake_parameters, training, unit_members
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.core.display import size
from lightning_shardlab.sharding import checkpointing, hooks
from lightning_shardlab.sharding.policy import UnitChoice, choose_units


@dataclass
class Moment:
    """The live bytes at one instant, and where in the step it was."""

    phase: str = "forward"
    where: str = ""  # the last engine event and the op: "pre_backward blocks.1, aten.mm"
    traced: int = 0  # what the traced step holds: batch, saved tensors, temporaries, parameters' gradients
    gathered: int = 0  # full buffers of the gathered units
    in_flight: int = 0  # collectives' buffers: flat gradients and new shards, receive rooms

    @property
    def total(self) -> int:
        return self.traced + self.gathered + self.in_flight


@dataclass
class PlannedPeak:
    """One rank's bytes at the step's busiest moment: the model state the device keeps between steps, and that
    moment's (a run's: budget/predicted/first_batch.py; a plan's: budget/predicted/setting.py)."""

    model_state: float  # the model state the device keeps between steps
    traced: float  # what the micro-batch holds then: saved activations, temporaries, gradients
    gathered: float  # stage 3: the units gathered then
    in_flight: float = 0.0  # the flat gradients (and receive rooms) of the reductions in flight then
    where: str = ""  # "backward: pre_backward blocks.3, aten.mm"

    @staticmethod
    def at(state: float, moment: Moment, number: type = int) -> PlannedPeak:
        """``state`` + ``moment``'s bytes, each as ``number`` (a plan's: floats)."""
        traced, gathered, in_flight = (number(v) for v in (moment.traced, moment.gathered, moment.in_flight))
        return PlannedPeak(state, traced, gathered, in_flight, f"{moment.phase}: {moment.where}")

    @property
    def total(self) -> float:
        return self.model_state + self.traced + self.gathered + self.in_flight

    def arithmetic(self) -> str:
        """'12.3 GB state + 20.2 GB traced + 4.1 GB gathered + 0.3 GB in flight = 36.9 GB (at backward: ...)'."""
        gb = functools.partial(size, decimal=True)
        return (
            f"{gb(self.model_state)} state + {gb(self.traced)} traced (activations, temporaries, gradients) +"
            f" {gb(self.gathered)} gathered + {gb(self.in_flight)} in flight = {gb(self.total)}"
            + (f" (at {self.where})" if self.where else "")
        )

    def fields(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "arithmetic": self.arithmetic()}


@dataclass
class StepTimeline:
    """The busiest moment of each phase of one traced step (bytes beyond the model state between steps)."""

    peaks: dict[str, Moment] = field(default_factory=dict)
    seconds: float = 0.0

    def busiest(self, optimizer: int | None, where: str) -> tuple[Moment, dict[str, Moment]]:
        """(the busiest moment, each phase's), the optimizer's step holding ``optimizer`` bytes at ``where`` (None:
        not predicted)."""
        moments = dict(self.peaks)
        if optimizer is not None:
            moments["optimizer"] = Moment("optimizer", where, traced=optimizer)
        return max(moments.values(), key=lambda m: m.total), moments


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of every storage an op under it makes, from then until Python frees it; after each op,
    ``sample()`` is told."""

    def __init__(self, sample: Callable[..., None], model_state: list[Tensor]) -> None:
        super().__init__()
        self.sample = sample
        self.live: dict[int, int] = {}  # id of the storage -> its bytes
        self.total = 0  # their sum
        self.state = {id(t.untyped_storage()) for t in model_state}  # the parameters' and buffers': not counted

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, Tensor):
                self._watch(tensor.untyped_storage())
        self.sample(str(func.overloadpacket), op=True)
        return out

    def _watch(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self.live and key not in self.state:
            self.live[key] = storage.nbytes()
            self.total += self.live[key]
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)


# ---- the run ----


class _Recorder:
    """Samples traced + engine bytes at every op and event; keeps each phase's busiest moment."""

    def __init__(self) -> None:
        self.live: LiveStorages | None = None
        self.engine: EngineStandIn | None = None
        self.event = ""
        self.timeline = StepTimeline()

    def __call__(self, what: str, op: bool = False) -> None:
        if self.live is None or self.engine is None:
            return
        if not op:
            self.event = what
        phase, engine = self.engine.phase, self.engine
        traced = self.live.total + sum(engine.rng_states.values())
        gathered, in_flight = engine.gathered_bytes, engine.in_flight_bytes
        best = self.timeline.peaks.get(phase)
        if best is None or traced + gathered + in_flight > best.total:  # a new busiest moment: say where it is
            where = f"{self.event}, {what}" if what != self.event else what
            self.timeline.peaks[phase] = Moment(phase, where, traced, gathered, in_flight)


def owning_unit(name: str, owner: dict[str, str]) -> str:
    """The unit whose module holds the module or parameter ``name`` (``owner``: each unit's modules -> the unit)."""
    parts = name.split(".")
    prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
    return next((owner[p] for p in prefixes if p in owner), ROOT)


def stand_ins(model: nn.Module, choice: UnitChoice, sizes: dict[str, UnitBytes]) -> list[StandInUnit]:
    """A stand-in per unit, the root first: its modules, its parameters (a tied one in the first unit holding it)."""
    owner = unit_members(choice)
    params: dict[str, list] = {ROOT: [], **{path: [] for path in choice.paths[1:]}}
    for name, param in model.named_parameters():
        params[owning_unit(name.rpartition(".")[0], owner)].append(param)
    return [
        StandInUnit(path or ROOT, [model.get_submodule(m) for m in choice.modules_of(path)], params[path or ROOT],
                    sizes[path or ROOT])
        for path in choice.paths
    ]  # fmt: skip


def hook_rng_states(model: nn.Module, names: list[str], choice: UnitChoice, engine: EngineStandIn) -> list[Any]:
    """What torch's checkpoint keeps beside a checkpointed module's inputs and no op makes: the CPU RNG state,
    taken as the module's forward runs, kept until its recomputation (counted until its unit's post-backward)."""
    owner = unit_members(choice)
    units = {unit.name: unit for unit in engine.units}
    nbytes = torch.get_rng_state().nbytes

    def keep(unit: StandInUnit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                engine.rng_states[unit] = engine.rng_states.get(unit, 0) + nbytes

        return hook

    return [
        model.get_submodule(name).register_forward_pre_hook(keep(units[owning_unit(name, owner)])) for name in names
    ]


def step_timeline(
    model: nn.Module,
    config: ShardLabConfig,
    sizes: dict[str, UnitBytes],
    make_batch: Callable[[], Any],
    step: Callable[[nn.Module, Any], Tensor],
    precision: str = "32-true",
) -> StepTimeline:
    """The busiest moment of forward and of backward of one micro-batch of ``model`` (its tensors are not read) run
    under fake tensors on the engine's schedule for ``config`` (its units, its ``activation_checkpointing``);
    ``sizes``: each unit's bytes, by name ("root" first). ``make_batch()`` runs inside the fake mode."""
    began = time.perf_counter()
    choice = choose_units(model, config)
    names = checkpointing.chosen_modules(model, config.activation_checkpointing, unit_members(choice), warn=False)
    recorder, mode = _Recorder(), FakeTensorMode(allow_non_fake_inputs=True)
    with ExitStack() as stack:
        stack.enter_context(training(model))
        stack.enter_context(fake_parameters(model, mode, precision))
        stack.callback(checkpointing.undo, model, checkpointing.apply(model, names))
        engine = EngineStandIn(stand_ins(model, choice, sizes), Schedule.of(config), recorder)
        handles = [h for unit in engine.units for h in hooks.install(engine, unit)]  # type: ignore[arg-type]
        handles += hook_rng_states(model, names, choice, engine)
        stack.callback(lambda: [h.remove() for h in handles])
        stack.enter_context(mode)
        stack.enter_context(torch.enable_grad())
        state = [*model.parameters(), *model.buffers()]
        recorder.live, recorder.engine = stack.enter_context(LiveStorages(recorder, state)), engine
        with computing(precision):
            loss = step(model, make_batch())
        engine.phase = "backward"
        recorder("backward")
        loss.backward()
        engine.finish_backward()
        del loss
        for param in model.parameters():
            param.grad = None
        recorder.live = None
    recorder.timeline.seconds = time.perf_counter() - began
    return recorder.timeline
