"""One micro-batch's forward traced under fake tensors (fake_step.py), nothing allocated: what it saves for backward
and the work it does, by unit, counted in one run.

Hooks on the units' modules say which unit's forward runs (the innermost, else the root), hooks on the checkpointed
modules (``activation_checkpointing``'s, else every unit's) what runs inside one. Both counts go to that unit:

- **saved**: each tensor autograd saves, as the run's meter counts it (budget/measured/activations.py), in the run's
  precision, without and with checkpointing. Checkpointing changes what is kept, not what is computed: a checkpointed
  module keeps only its tensor inputs, and its backward recomputes what it saved less those (``recompute_peak``: the
  largest).
- **work**: FLOPs, memory-bound bytes and kernels (compute_trace.py), the root's share before the first unit
  (embeddings) as its ``lead``, and what runs inside a checkpointed module again as ``recompute``: with checkpointing
  on, backward runs it a second time (``ComputeTrace.checkpointed``).

Kernels are the CPU's: where a GPU picks one that saves differently (attention's math fallback), the figure follows
the CPU.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from lightning_shardlab.budget.measured.activations import ROOT, SavedBytes, storage_key
from lightning_shardlab.budget.predicted.compute_trace import HEAVIEST, ComputeTrace, UnitWork, Work, WorkMode
from lightning_shardlab.budget.predicted.fake_step import (
    STEPS,
    MakeInputs,
    Step,
    Untraced,
    computing,
    first_step_that_runs,
    hook_units,
    steps_for,
    token_batch,
    unit_members,
)
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding.checkpointing import chosen_modules
from lightning_shardlab.sharding.policy import UnitChoice, choose_units


@dataclass
class ActivationTrace:
    """What one micro-batch's forward saves for backward, by unit (the root first, then the units in order)."""

    micro_batch_size: int
    seq_len: int
    precision: str
    step: str  # what ran: "training_step" or "forward"
    by_unit: dict[str, int]  # bytes saved, without checkpointing
    checkpointed_by_unit: dict[str, int]  # bytes saved with the checkpointed modules keeping only their inputs
    recompute_by_unit: dict[str, int]  # per unit: the largest recomputation of one of its checkpointed modules
    checkpointed: list[str] = field(default_factory=list)  # the checkpointed modules' names
    seconds: float = 0.0  # how long the trace took

    @property
    def total(self) -> int:
        return sum(self.by_unit.values())

    @property
    def checkpointed_total(self) -> int:
        return sum(self.checkpointed_by_unit.values())

    @property
    def recompute_peak(self) -> int:
        return max(self.recompute_by_unit.values(), default=0)

    def saved(self, checkpointing: bool) -> int:
        """Bytes kept for backward at its start: with checkpointing, the modules' inputs in place of their insides."""
        return self.checkpointed_total if checkpointing else self.total

    def fields(self) -> dict[str, Any]:
        """The plan's ``activations``: the figures with their totals, each unit's recomputation left out."""
        names = "micro_batch_size seq_len precision step by_unit total checkpointed_by_unit checkpointed_total"
        return {name: getattr(self, name) for name in (*names.split(), "recompute_peak", "checkpointed", "seconds")}


@dataclass
class ForwardTrace:
    """One micro-batch's forward: what it saves (``activations``) and what it does (``work``, its checkpointed
    modules' forward as ``recompute``)."""

    activations: ActivationTrace
    work: ComputeTrace


class _Counter:
    """Charges what the forward saves and does to the unit running, and inside a checkpointed module apart."""

    def __init__(self, model: nn.Module, choice: UnitChoice, checkpointed: list[str], params: set[int]) -> None:
        self.params = params
        self.plain, self.kept = SavedBytes(params), SavedBytes(params)  # saved without, and with checkpointing
        self.recomputed: dict[str, int] = {}  # unit -> its largest checkpointed module's saved bytes
        self.running: list[str] = []  # the units whose forward runs, innermost last
        self.inside: list[tuple[str, SavedBytes]] = []  # the outermost checkpointed module running, its count
        self.held: list[Tensor] = []  # every tensor packed, until the trace ends
        self.work, self.last = WorkMode(), Work()
        self.forward: dict[str, Work] = {}
        self.recompute: dict[str, Work] = {}
        self.lead = Work()  # the root's, before the first unit
        self.order: list[str] = []  # the units in the order their forward first ran
        self.handles = hook_units(model, choice, self._enter, self._leave)
        for name in checkpointed:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(self._enter_checkpointed, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._leave_checkpointed))

    @property
    def current(self) -> str:
        return self.running[-1] if self.running else ROOT

    def read(self) -> Work:
        return Work(self.work.flops, float(self.work.bytes), float(self.work.ops))

    def mark(self) -> None:
        """The work done since the last mark, charged to the unit running (and to its recompute, inside one)."""
        now = self.read()
        delta, self.last, unit = now - self.last, now, self.current
        self.forward[unit] = self.forward.get(unit, Work()) + delta
        if self.inside:
            self.recompute[unit] = self.recompute.get(unit, Work()) + delta
        if unit == ROOT and not self.order:
            self.lead = self.lead + delta

    def _enter(self, unit: str) -> None:
        self.mark()
        self.running.append(unit)
        if unit not in self.order:
            self.order.append(unit)

    def _leave(self) -> None:
        self.mark()
        self.running.pop()

    def _enter_checkpointed(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.mark()
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
        if not self.inside and torch.is_grad_enabled():
            for tensor in inputs:
                self.kept.add(self.current, tensor)
        own = SavedBytes(self.params | {storage_key(t) for t in inputs})
        self.inside.append((self.current, own) if not self.inside else self.inside[-1])

    def _leave_checkpointed(self, module: nn.Module, args: Any, output: Any) -> None:
        self.mark()
        unit, own = self.inside.pop()
        if not self.inside:
            self.recomputed[unit] = max(self.recomputed.get(unit, 0), own.total)

    def pack(self, tensor: Tensor) -> None:
        """Count ``tensor``, and hold it here until the trace ends (so no storage is freed and its identity reused
        while storages are being told apart), not in autograd's node: no backward follows a trace, and a tensor
        packed there would hold its own graph in a cycle through autograd's nodes that Python cannot collect."""
        self.held.append(tensor)
        self.plain.add(self.current, tensor)
        (self.inside[-1][1] if self.inside else self.kept).add(self.current, tensor)

    def remove(self) -> None:
        self.held.clear()
        for handle in self.handles:
            handle.remove()

    def compute(self, seconds: float) -> ComputeTrace:
        """The units' work, and the heaviest ops for the rate probes (compute_rate.py)."""
        self.mark()
        by_unit = {name: UnitWork(self.forward.get(name, Work()), self.recompute.get(name, Work()))
                   for name in [ROOT, *self.order]}  # fmt: skip
        by_unit[ROOT] = dataclasses.replace(by_unit[ROOT], lead=self.lead)
        memory_ops = sorted(self.work.memory_ops.values(), key=lambda op: -op.bytes)[:HEAVIEST]
        flop_ops = sorted(self.work.flop_ops.values(), key=lambda op: -op.flops)[:HEAVIEST]
        return ComputeTrace(by_unit, dict(self.work.matmuls), seconds, memory_ops=memory_ops, flop_ops=flop_ops)


def _unpack(packed: None) -> Tensor:
    raise RuntimeError("a traced forward has no backward: fake tensors are counted, not kept")


def trace_forward(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    precision: str = "32-true",
    *,
    config: ShardLabConfig | None = None,
    make_inputs: MakeInputs | None = None,
    step: Step | None = None,
) -> ForwardTrace:
    """One micro-batch of ``model`` (its tensors are not read) by unit of ``config``'s policy: the bytes autograd saves
    without and with activation checkpointing (``config.activation_checkpointing``'s modules, else every unit's), and
    its work. ``make_inputs(model, B, T)`` makes the batch inside the fake mode (default: token ids and targets);
    ``step(model, batch)`` returns the loss (default: ``steps_for``). ``Untraced`` when the model does not run."""
    config = config or ShardLabConfig()
    choice = choose_units(model, config)
    option = getattr(config, "activation_checkpointing", False) or True
    checkpointed = chosen_modules(model, option, unit_members(choice), warn=False)
    began = time.perf_counter()

    def run(attempt: Step, mode: FakeTensorMode, params: set[int]) -> _Counter:
        counter = _Counter(model, choice, checkpointed, params)
        try:
            with mode, torch.enable_grad(), computing(precision):
                batch = (make_inputs or token_batch)(model, micro_batch_size, seq_len)
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack), counter.work:
                    counter.last = counter.read()
                    attempt(model, batch)
            return counter
        finally:
            counter.remove()

    try:
        counter, attempt = first_step_that_runs(model, [step] if step else steps_for(model), precision, run)
    except Untraced as err:
        raise Untraced(
            f"{type(model).__name__} did not run one micro-batch ({micro_batch_size} x {seq_len}) under fake"
            f" tensors: {err}. HINT: check --seq-len against the model's context; or give trace_forward a"
            " make_inputs= and step= for this model.",
            err.why,
        ) from None
    seconds, order = time.perf_counter() - began, [ROOT, *choice.paths[1:]]
    activations = ActivationTrace(
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        step=next((name for name, known in STEPS.items() if known is attempt), "step"),
        by_unit={name: counter.plain.by_unit.get(name, 0) for name in order},
        checkpointed_by_unit={name: counter.kept.by_unit.get(name, 0) for name in order},
        recompute_by_unit=dict(counter.recomputed),
        checkpointed=checkpointed,
        seconds=seconds,
    )
    return ForwardTrace(activations, counter.compute(seconds))
