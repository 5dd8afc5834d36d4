"""The work of one micro-batch, by unit, traced under fake tensors: FLOPs, memory-bound bytes and kernels.

This file only counts (step_time.py turns work into seconds), as the user's step runs under ``FakeTensorMode``
(activation_trace.py): **FLOPs** by torch's ``FlopCounterMode`` (attention by torch's formula, causal masking not
subtracted); every other op that makes a tensor is memory-bound and costs the **bytes** it moves (its outputs, each
input read up to its largest output's size: an embedding reads the rows it gathers, not the table); each **kernel** a
fixed cost (views and allocations none). Counts go to the unit whose forward runs, and to ``recompute`` inside a
checkpointed module; the root's share before the first unit (embeddings) is its ``lead``. Backward is derived, not
traced (``Work.backward``). The heaviest shapes and ops are kept for the rate probes (compute_rate.py); the
optimizer's step is counted the same way (``optimizer_work``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count, shape_wrapper

from lightning_shardlab.budget.measured.activations import ROOT
from lightning_shardlab.budget.predicted.activation_trace import (
    Step,
    Untraced,
    computing,
    fake_like,
    first_step_that_runs,
    hook_units,
    steps_for,
    token_batch,
    unit_members,
)
from lightning_shardlab.budget.predicted.optimizer_peak import second_step
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig
from lightning_shardlab.sharding.checkpointing import chosen_modules
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.policy import choose_units

aten = torch.ops.aten


def _attention_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu  # not in torch's flop registry
MATMULS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}  # (lhs, rhs) arguments
HEAVIEST = 6  # memory-bound ops, and other FLOP ops, kept for the rate probes
FLOP_FORMULAS = {  # the FLOPs of each op that does FLOPs and is not a matmul: torch's formulas (taking tensors)
    **{op: formula for op, formula in flop_registry.items() if op not in MATMULS},
    CPU_ATTENTION: shape_wrapper(_attention_flops),
}
NO_WORK = {aten._unsafe_view, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty}  # nothing moves


@dataclass(frozen=True)
class Work:
    """What some ops cost, in the three quantities the time model prices."""

    flops: float = 0.0  # FLOPs of the matmul-like ops (torch's flop counter)
    bytes: float = 0.0  # bytes the other ops read and write (memory-bound)
    ops: float = 0.0  # kernels run, each with a fixed cost (dispatch, launch)

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)

    def __sub__(self, other: Work) -> Work:
        return Work(self.flops - other.flops, self.bytes - other.bytes, self.ops - other.ops)

    def scaled(self, k: float) -> Work:
        return Work(self.flops * k, self.bytes * k, self.ops * k)

    def backward(self) -> Work:
        """The backward of this forward work: a matmul's is two matmuls of its size (the gradients of its input and
        of its weight): 2 x the FLOPs; a memory-bound op's reads the output's gradient and what it saved and writes
        the input's gradient: about the bytes of its forward; about two kernels for each forward one (the gradient,
        and its accumulation or reduction). Against a plain eager backward of the zoo's six models
        (benchmarks/TIME_PREDICTION.md): within 15 % where matmuls or kernels carry the step, over where memory-bound
        ops whose inputs need no gradient (masks, positions) or light backwards (pooling) do."""
        return Work(2 * self.flops, self.bytes, 2 * self.ops)


@dataclass(frozen=True)
class UnitWork:
    """One unit's work per micro-batch."""

    forward: Work = Work()
    recompute: Work = Work()  # the forward of its checkpointed modules, run again in backward
    lead: Work = Work()  # the root only: its forward before the first unit runs (the rest runs after the units)

    @property
    def backward(self) -> Work:
        """The forward's backward (``Work.backward``), + the recompute."""
        return self.forward.backward() + self.recompute


@dataclass
class ComputeTrace:
    """One micro-batch's work by unit (the root first, then the units in the order their forward ran)."""

    by_unit: dict[str, UnitWork] = field(default_factory=dict)
    matmuls: dict[tuple[int, int, int, int], float] = field(default_factory=dict)  # (batch, m, k, n) -> FLOPs
    seconds: float = 0.0  # how long the trace took
    error: str | None = None  # why there is no trace
    why: str | None = None  # ... in a few words, for the tables (step_stand_ins.py's ``in_words``)
    memory_ops: list[TracedOp] = field(default_factory=list)  # the heaviest memory-bound ops, most bytes first
    flop_ops: list[TracedOp] = field(default_factory=list)  # the heaviest other FLOP ops (convolutions, attention)

    def flops(self) -> dict[str, float]:
        """Forward FLOPs per unit."""
        return {name: work.forward.flops for name, work in self.by_unit.items()}

    @staticmethod
    def of_flops(flops: dict[str, float]) -> ComputeTrace:
        """From forward FLOPs per unit alone (no memory-bound bytes, no kernels)."""
        return ComputeTrace({name: UnitWork(Work(flops=f)) for name, f in flops.items()})


# ---- counting ----


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class TracedOp:
    """One op as a trace met it: the op, its arguments with each tensor as a ``TensorSpec``, and in all its calls
    the bytes it moved (a memory-bound op) or the FLOPs it did (a convolution, attention): budget/predicted/
    compute_rate.py times the heaviest of each kind for real."""

    func: Any
    template: tuple[Any, dict]
    bytes: float = 0.0
    calls: int = 0
    flops: float = 0.0


class WorkMode(TorchDispatchMode):
    """Counts the memory-bound bytes and the kernels of the ops under it, the matmuls' shapes, and the other ops
    that do FLOPs (convolutions, attention) by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0  # bytes
        self.ops = 0  # kernels
        self.matmuls: dict[tuple[int, int, int, int], float] = {}
        self.memory_ops: dict[str, TracedOp] = {}  # the memory-bound ops by op and shapes, with their bytes
        self.flop_ops: dict[str, TracedOp] = {}  # the other ops that do FLOPs, by op and shapes, with their FLOPs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        packet = getattr(func, "overloadpacket", func)  # a higher-order op has no packet, and is no view
        if not outputs or getattr(func, "is_view", False) or packet in NO_WORK:
            return out
        self.ops += 1
        if packet in MATMULS:
            self._matmul(args[MATMULS[packet][0]].shape, args[MATMULS[packet][1]].shape)
        elif packet in FLOP_FORMULAS:
            flops = FLOP_FORMULAS[packet](*args, **(kwargs or {}), out_val=out)
            self._note(self.flop_ops, func, args, kwargs or {}).flops += flops
        else:
            largest = max(_nbytes(t) for t in outputs)
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            moved = sum(_nbytes(t) for t in outputs) + sum(min(_nbytes(t), largest) for t in inputs)
            self.bytes += moved
            self._note(self.memory_ops, func, args, kwargs or {}).bytes += moved
        return out

    @staticmethod
    def _note(kept: dict[str, TracedOp], func: Any, args: Any, kwargs: dict) -> TracedOp:
        """The op's entry by its shapes (its tensors as (shape, dtype)), so that a probe can run it for real; one
        more call counted."""
        template = tree_map(
            lambda t: TensorSpec(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t, (args, kwargs)
        )
        op = kept.setdefault(f"{func}{template}", TracedOp(func, template))
        op.calls += 1
        return op

    def _matmul(self, lhs: torch.Size, rhs: torch.Size) -> None:
        batch = lhs[0] if len(lhs) == 3 else 1
        key = (batch, lhs[-2], lhs[-1], rhs[-1])  # (batch, m, k, n)
        self.matmuls[key] = self.matmuls.get(key, 0.0) + 2.0 * batch * lhs[-2] * lhs[-1] * rhs[-1]


class _ByUnit:
    """Charges the counters' growth between two module boundaries to the unit running then."""

    def __init__(self, read: Callable[[], Work]) -> None:
        self.read, self.last = read, Work()
        self.running: list[str] = []  # the units whose forward runs, innermost last
        self.checkpointed = 0  # depth inside checkpointed modules
        self.forward: dict[str, Work] = {}
        self.recompute: dict[str, Work] = {}
        self.lead = Work()
        self.order: list[str] = []  # the units in the order their forward first ran

    def mark(self) -> None:
        now = self.read()
        delta, self.last = now - self.last, now
        unit = self.running[-1] if self.running else ROOT
        self.forward[unit] = self.forward.get(unit, Work()) + delta
        if self.checkpointed:
            self.recompute[unit] = self.recompute.get(unit, Work()) + delta
        if unit == ROOT and not self.order:
            self.lead = self.lead + delta

    def hook(self, model: nn.Module, config: ShardLabConfig) -> list[Any]:
        """Forward hooks on the units' modules and on the checkpointed ones; returns their handles."""
        choice = choose_units(model, config)
        handles = hook_units(model, choice, self._enter, self._leave)
        names = chosen_modules(model, config.activation_checkpointing, unit_members(choice), warn=False)
        for name in names if config.activation_checkpointing else []:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(lambda *_: self._checkpointed(+1)))
            handles.append(module.register_forward_hook(lambda *_: self._checkpointed(-1)))
        return handles

    def _enter(self, path: str) -> None:
        self.mark()
        self.running.append(path)
        if path not in self.order:
            self.order.append(path)

    def _leave(self) -> None:
        self.mark()
        self.running.pop()

    def _checkpointed(self, step: int) -> None:
        self.mark()
        self.checkpointed += step

    def trace(self, work: WorkMode, seconds: float) -> ComputeTrace:
        """The units' work, and the heaviest ops of ``work`` for the rate probes."""
        self.mark()
        units = [ROOT, *self.order]
        by_unit = {name: UnitWork(self.forward.get(name, Work()), self.recompute.get(name, Work())) for name in units}
        by_unit[ROOT] = dataclasses.replace(by_unit[ROOT], lead=self.lead)
        memory_ops = sorted(work.memory_ops.values(), key=lambda op: -op.bytes)[:HEAVIEST]
        flop_ops = sorted(work.flop_ops.values(), key=lambda op: -op.flops)[:HEAVIEST]
        return ComputeTrace(by_unit, dict(work.matmuls), seconds, memory_ops=memory_ops, flop_ops=flop_ops)


# ---- the traces ----


def trace_compute(
    model: nn.Module, make_batch: Callable[[], Any], steps: list[Step], precision: str, config: ShardLabConfig
) -> ComputeTrace:
    """One micro-batch of ``model`` (its tensors are not read) through the first of ``steps`` that runs under fake
    tensors, its work counted by unit of ``config``'s policy; ``make_batch()`` runs inside the fake mode. A model that
    does not run gives a trace whose ``error`` says why."""
    began = time.perf_counter()

    def run(step: Step, mode: FakeTensorMode, _: set[int]) -> ComputeTrace:
        flops = FlopCounterMode(display=False, custom_mapping={CPU_ATTENTION: _attention_flops})
        work = WorkMode()
        units = _ByUnit(lambda: Work(float(flops.get_total_flops()), float(work.bytes), float(work.ops)))
        handles = units.hook(model, config)
        try:
            with mode, torch.enable_grad(), computing(precision):
                batch = make_batch()
                with flops, work:
                    units.last = units.read()
                    step(model, batch)
        finally:
            for handle in handles:
                handle.remove()
        return units.trace(work, time.perf_counter() - began)

    try:
        return first_step_that_runs(model, steps, precision, run)[0]
    except Untraced as err:
        return ComputeTrace(seconds=time.perf_counter() - began, error=str(err), why=err.why)


def unit_flops_for_batch(clone: nn.Module, batch: Any, config: ShardLabConfig, precision: str) -> ComputeTrace:
    """The run's first batch (only its shapes and dtypes matter) through ``clone`` (budget/predicted/
    activation_prediction.py's ``meta_clone`` of the module, taken before sharding): its work per micro-batch by unit of
    the run's own units. ``.flops()`` gives the forward FLOPs per unit; ``.error`` says why when it did not run."""
    return trace_compute(clone, lambda: fake_like(batch), steps_for(clone), precision, config)


def trace_plan_compute(
    model: nn.Module, micro_batch_size: int, seq_len: int, precision: str, config: ShardLabConfig
) -> ComputeTrace:
    """A plan's micro-batch of token ids (``micro_batch_size`` x ``seq_len``) through a meta-device model."""
    return trace_compute(
        model, lambda: token_batch(model, micro_batch_size, seq_len), steps_for(model), precision, config
    )


# ---- the optimizer's step ----


def master_sizes(layouts: list[FlatParamLayout], rank: int = 0) -> list[tuple[int, torch.dtype]]:
    """The 1-D master views ``rank`` steps (sharding/optimizer.py): each trained parameter's part of its shard."""
    sizes = []
    for lay in layouts:
        for slot in lay.slots if lay.requires_grad else ():
            lo, hi = lay.slot_in_shard(slot, rank)
            if hi > lo:
                sizes.append((hi - lo, lay.dtype))
    return sizes


def optimizer_work(
    cls: type[Optimizer],
    options: dict[str, Any],
    layouts: list[FlatParamLayout],
    policy: PrecisionPolicy,
    rank: int = 0,
) -> Work:
    """The bytes and kernels of one step of ``cls`` (with ``options``) over fake 1-D masters of ``rank``'s views
    (``master_sizes``): its second step (the first makes the state, as a run's first step did); with the
    mixed-precision copies around it (``precision_copies``)."""
    sizes = master_sizes(layouts, rank)
    if not sizes:
        return precision_copies(layouts, policy)
    with second_step(cls, [(options, [(torch.Size([n]), dtype) for n, dtype in sizes])]) as (stand_in, _):
        with WorkMode() as counted:
            stand_in.step()
    return Work(0.0, float(counted.bytes), float(counted.ops)) + precision_copies(layouts, policy)


def precision_copies(layouts: list[FlatParamLayout], policy: PrecisionPolicy) -> Work:
    """Mixed precision around the update: each grad shard read and written as an fp32 copy for the optimizer, and each
    compute shard rewritten from its master after it (sharding/gradients.py, ``FlatParam.shard_from_master``)."""
    nbytes = 0.0
    for lay in layouts:
        c, m = policy.compute_for(lay.dtype).itemsize, lay.dtype.itemsize
        if lay.requires_grad and c != m:
            nbytes += 2 * (c + m) * lay.shard_numel  # bytes: grad c -> m, then master m -> compute c
    return Work(0.0, nbytes, 2.0 * sum(1 for lay in layouts if lay.requires_grad) if nbytes else 0.0)
