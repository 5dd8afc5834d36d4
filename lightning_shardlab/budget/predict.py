"""The budget, predicted: what each rank should hold and move, from the real layout (or a parameter count).

Everything here is arithmetic on ``FlatParamLayout``s — no tensors, no processes — so the same
functions predict a run that is happening (set against what the ledger measures) and a run that is
only planned (``shardlab plan``, any world size). Categories match ``ledger.measure_memory``.

The ZeRO table, per parameter, mixed precision with Adam: 2 B compute copy +
2 B gradient + 4 B fp32 master + 8 B moments = 16 B; in fp32 the compute copy is the master: 4 + 4 + 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_shardlab.budget.measure import MEMORY_CATEGORIES
from lightning_shardlab.config import PrecisionPolicy, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout

# per-element optimizer state tensors of torch's elementwise optimizers (before hyperparameter extras)
STATE_TENSORS = {
    "SGD": 0,
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Rprop": 2,
    "ASGD": 1,
}
SCALAR_STATE_BYTES = {
    "Adam": 4,
    "AdamW": 4,
    "Adamax": 4,
    "NAdam": 8,
    "RAdam": 4,
    "Adadelta": 4,
    "Adagrad": 4,
    "RMSprop": 4,
    "Rprop": 4,
    "ASGD": 12,
}  # 'step' (and NAdam's mu_product, ASGD's eta, mu)


@dataclass(frozen=True)
class OptimizerShape:
    """How much state an optimizer keeps: tensors per element, and scalar bytes per parameter tensor."""

    per_element: int = 2
    scalar_bytes: int = 4

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> OptimizerShape:
        name = type(optimizer).__name__
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        extra = int(bool(group.get("amsgrad"))) + int(group.get("momentum", 0) != 0 and name == "RMSprop")
        extra += int(bool(group.get("centered")))
        per = STATE_TENSORS.get(name, 2) + extra
        if name == "SGD":
            per = int(group.get("momentum", 0) != 0)
        return OptimizerShape(per, SCALAR_STATE_BYTES.get(name, 0))

    @staticmethod
    def named(name: str) -> OptimizerShape:
        key = {n.lower(): n for n in STATE_TENSORS}[name.lower()]
        return OptimizerShape(STATE_TENSORS[key] if key != "SGD" else 1, SCALAR_STATE_BYTES.get(key, 0))


def _real_in_shard(layout: FlatParamLayout, rank: int) -> int:
    return layout.shard_numel - layout.padding_in_shard(rank)


def predict_memory(
    layouts: list[FlatParamLayout], stage: Stage, policy: PrecisionPolicy, rank: int, optimizer: OptimizerShape | None
) -> dict[str, int]:
    """Bytes ``rank`` holds between steps, by the ledger's categories, from the layout alone."""
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    for lay in layouts:
        compute = policy.compute_for(lay.dtype)
        c, m = compute.itemsize, lay.dtype.itemsize
        whole = stage is not Stage.PARAMETERS or lay.world_size == 1
        out["params"] += (lay.padded_numel if whole else lay.shard_numel) * c
        out["padding"] += (lay.padding if whole else lay.padding_in_shard(rank)) * c
        if compute != lay.dtype:
            out["master"] += lay.shard_numel * m
        if lay.requires_grad:
            out["grads"] += lay.shard_numel * c
            out["padding"] += lay.padding_in_shard(rank) * c
            if optimizer is not None:
                out["optimizer_state"] += _real_in_shard(lay, rank) * optimizer.per_element * m
                out["optimizer_state"] += len(lay.slots) * optimizer.scalar_bytes
    return out


def predict_gathered_peak(units: dict[str, list[FlatParamLayout]], stage: Stage, policy: PrecisionPolicy) -> int:
    """Stage 3: bytes of gathered full buffers at the busiest moment: the root (held for the step) plus
    two neighbouring units — one computing, the next prefetched (forward order taken as the units' order,
    which is registration order). 0 at stages 1-2, whose full buffers are counted in ``params``."""
    if stage is not Stage.PARAMETERS:
        return 0

    def size(lays: list[FlatParamLayout]) -> int:
        return sum(lay.padded_numel * policy.compute_for(lay.dtype).itemsize for lay in lays if lay.world_size > 1)

    root = size(units.get("root", []))
    others = [size(lays) for name, lays in units.items() if name != "root"]
    pairs = [a + b for a, b in zip(others, others[1:])] or others
    return root + max(pairs, default=0)


@dataclass(frozen=True)
class Traffic:
    """Collectives per optimizer step: calls and bytes of the full (gathered / reduced) tensors."""

    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.all_gather_bytes + self.reduce_scatter_bytes


def predict_traffic(
    units: dict[str, list[FlatParamLayout]],
    stage: Stage,
    policy: PrecisionPolicy,
    micro_batches: int = 1,
    reduce_every_micro_batch: bool = True,
    reshard_after_forward: bool = True,
) -> Traffic:
    """Per optimizer step, in the steady state. Stage 3: all-gather each unit before forward and again
    before backward (the root, and the unit that runs forward last, once per micro-batch), reduce-scatter
    its gradient. Stages 1-2: reduce-scatter, then all-gather the updated shards after the step. Counts
    the full tensor of each call, the size torch's collectives are given."""
    ag_calls = ag_bytes = rs_calls = rs_bytes = 0
    reductions = micro_batches if reduce_every_micro_batch else 1
    others = [name for name in units if name != "root"]
    last = others[-1] if others else None  # the forward order taken as the units' order
    for name, lays in units.items():
        for lay in lays:
            if lay.world_size == 1:
                continue
            compute = policy.compute_for(lay.dtype)
            reduce = policy.reduce_dtype or lay.dtype
            if stage is Stage.PARAMETERS:  # the last unit stays gathered from its forward to its backward
                once = name == "root" or not reshard_after_forward or name == last
                gathers = micro_batches * (1 if once else 2)
            else:
                gathers = 1 if lay.requires_grad else 0
            ag_calls += gathers
            ag_bytes += gathers * lay.padded_numel * compute.itemsize
            if lay.requires_grad:
                rs_calls += reductions
                rs_bytes += reductions * lay.padded_numel * reduce.itemsize
    return Traffic(ag_calls, ag_bytes, rs_calls, rs_bytes)


def zero_table_bytes(
    params: float, world_size: int, stage: Stage, mixed: bool = True, optimizer: OptimizerShape | None = None
) -> dict[str, float]:
    """Per-rank bytes by category from a parameter count alone (no layout, no padding): the ZeRO table."""
    optimizer = optimizer or OptimizerShape()
    p, n = params, world_size
    w, g, m = (2, 2, 4) if mixed else (4, 4, 0)
    state = 4 * optimizer.per_element
    if stage is Stage.PARAMETERS:
        return {"params": w * p / n, "grads": g * p / n, "master": m * p / n, "optimizer_state": state * p / n}
    return {"params": w * p, "grads": g * p / n, "master": m * p / n, "optimizer_state": state * p / n}


@dataclass(frozen=True)
class Interconnect:
    """One rank's link: bytes per second in each direction, and the latency of one message."""

    name: str
    bandwidth: float
    latency: float

    def ring_seconds(self, nbytes: float, world_size: int) -> float:
        """Lower bound for a ring all-gather / reduce-scatter of a ``nbytes`` full tensor: each rank sends
        and receives (N-1)/N of it, in N-1 messages."""
        n = world_size
        return (n - 1) / n * nbytes / self.bandwidth + (n - 1) * self.latency


INTERCONNECTS = {
    "nvlink": Interconnect("NVLink 4 (H100 SXM), 450 GB/s per direction", 450e9, 5e-6),
    "pcie4": Interconnect("PCIe 4.0 x16, ~25 GB/s", 25e9, 10e-6),
    "pcie5": Interconnect("PCIe 5.0 x16, ~50 GB/s", 50e9, 10e-6),
    "infiniband": Interconnect("InfiniBand HDR 200 Gb/s, 25 GB/s", 25e9, 5e-6),
    "infiniband-ndr": Interconnect("InfiniBand NDR 400 Gb/s, 50 GB/s", 50e9, 5e-6),
    "10gbe": Interconnect("10 Gigabit Ethernet, 1.25 GB/s", 1.25e9, 50e-6),
}

DEVICES = {  # dense peak FLOP/s in the compute dtype
    "h100": 989e12,
    "a100": 312e12,
    "h200": 989e12,
    "l4": 121e12,
    "cpu-core": 5e10,
}
