"""The work of some ops, counted as they run under fake tensors: FLOPs, memory-bound bytes and kernels.

This file only counts (step_time.py turns work into seconds): **FLOPs** of each matmul (2 m k n) and, by torch's
flop counter's formulas, of each other op that does FLOPs (convolutions; attention, causal masking not subtracted);
every other op that makes a tensor is memory-bound and costs the **bytes** it moves (its outputs, each input read up
to its largest output's size: an embedding reads the rows it gathers, not the table); each **kernel** a fixed cost
(views and allocations none). A micro-batch's forward is counted by unit in forward_trace.py; backward is derived,
not traced (``Work.backward``). The heaviest shapes and ops are kept for the rate probes (compute_rate.py); the
optimizer's step is counted the same way (``optimizer_work``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper

from lightning_shardlab.budget.predicted.optimizer_peak import second_step
from lightning_shardlab.core.config import PrecisionPolicy
from lightning_shardlab.sharding.flat_param import FlatParamLayout

aten = torch.ops.aten


def attention_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu  # not in torch's flop registry
MATMULS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}  # (lhs, rhs) arguments
HEAVIEST = 6  # memory-bound ops, and other FLOP ops, kept for the rate probes
FLOP_FORMULAS = {  # the FLOPs of each op that does FLOPs and is not a matmul: torch's formulas (taking tensors)
    **{op: formula for op, formula in flop_registry.items() if op not in MATMULS},
    CPU_ATTENTION: shape_wrapper(attention_flops),
}
NO_WORK = {aten._unsafe_view, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty}  # nothing moves


@dataclass(frozen=True)
class Work:
    """What some ops cost, in the three quantities the time model prices."""

    flops: float = 0.0  # FLOPs of the matmuls, convolutions and attention
    bytes: float = 0.0  # bytes the other ops read and write (memory-bound)
    ops: float = 0.0  # kernels run, each with a fixed cost (dispatch, launch)

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)

    def __sub__(self, other: Work) -> Work:
        return Work(self.flops - other.flops, self.bytes - other.bytes, self.ops - other.ops)

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

    def checkpointed(self, on: bool) -> ComputeTrace:
        """The work of a step with activation checkpointing ``on`` (its modules' forward run again in backward) or
        off (nothing recomputed)."""
        if on:
            return self
        by_unit = {name: dataclasses.replace(work, recompute=Work()) for name, work in self.by_unit.items()}
        return dataclasses.replace(self, by_unit=by_unit)


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
        self.flops = 0.0  # FLOPs of the matmuls and the other ops that do FLOPs
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
            self.flops += flops
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
        flops = 2.0 * batch * lhs[-2] * lhs[-1] * rhs[-1]
        self.matmuls[key] = self.matmuls.get(key, 0.0) + flops
        self.flops += flops


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
