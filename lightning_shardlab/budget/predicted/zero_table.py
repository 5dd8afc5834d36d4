"""The budget, predicted: what each rank should hold and move, from the real layout (or a parameter count).

Everything here is arithmetic on ``FlatParamLayout``s — no tensors, no processes — so the same
functions predict a run that is happening (set against what the ledger measures) and a run that is
only planned (``shardlab plan``, any world size). Categories match ``ledger.measure_memory``.

The ZeRO table, per parameter, mixed precision with Adam: 2 B compute copy +
2 B gradient + 4 B fp32 master + 8 B moments = 16 B; in fp32 the compute copy is the master: 4 + 4 + 8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES
from lightning_shardlab.comm.packing import Packing
from lightning_shardlab.core.config import PrecisionPolicy, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.optimizer import OptimizerShape

if TYPE_CHECKING:
    from lightning_shardlab.budget.predicted.whole_tensor import WholePlan


def _real_in_shard(layout: FlatParamLayout, rank: int) -> int:
    return layout.shard_numel - layout.padding_in_shard(rank)


def predict_memory(
    layouts: list[FlatParamLayout],
    stage: Stage,
    policy: PrecisionPolicy,
    rank: int,
    optimizer: OptimizerShape | None,
    offload: str = "none",
    *,
    error_feedback: bool | None = None,
) -> dict[str, int]:
    """Bytes ``rank`` holds between steps, by the ledger's categories, from the layout alone (wherever they
    live: budget/measured/tiers.py splits them by tier; ``offload='cpu'`` gives every trainable shard a master of its
    own in host memory, fp32 training included). ``error_feedback``: int8 reductions keep a residual
    (``reduce_dtype='int8'``; None: read from ``policy.reduce_dtype``, which the Trainer's and Fabric's precision set
    from it): every trainable floating flat parameter sharded over more than one rank keeps one of its whole flat
    length, the shard group's W gradient shards, in fp32 (sharding/flat_param.py ``residual``)."""
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    for lay in layouts:
        compute = policy.compute_for(lay.dtype)
        c, m = compute.itemsize, lay.dtype.itemsize
        whole = stage is not Stage.PARAMETERS or lay.world_size == 1
        out["params"] += (lay.padded_numel if whole else lay.shard_numel) * c
        out["padding"] += (lay.padding if whole else lay.padding_in_shard(rank)) * c
        if compute != lay.dtype or (offload == "cpu" and lay.requires_grad):
            out["master"] += lay.shard_numel * m
        if lay.requires_grad:
            out["grads"] += lay.shard_numel * c
            out["padding"] += lay.padding_in_shard(rank) * c
            if optimizer is not None:
                real = _real_in_shard(lay, rank)
                held = lay.shard_numel if offload == "disk" and real else real  # a file holds the whole shard
                out["optimizer_state"] += held * optimizer.per_element * m
                out["optimizer_state"] += len(lay.slots) * optimizer.scalar_bytes
        out["error_feedback"] += _residual_bytes(
            lay, policy.reduce_dtype is torch.int8 if error_feedback is None else error_feedback
        )
    return out


def _residual_bytes(lay: FlatParamLayout, error_feedback: bool) -> int:
    """Bytes of ``lay``'s error-feedback residual: one fp32 element per gradient element the shard group reduces
    (its W shards), where int8 reductions keep one."""
    kept = error_feedback and lay.requires_grad and lay.dtype.is_floating_point
    return lay.world_size * lay.shard_numel * 4 if kept and lay.world_size > 1 else 0


@dataclass(frozen=True)
class Traffic:
    """Collectives per optimizer step: calls and bytes of the full (gathered / reduced) tensors.

    The totals count every all-gather and reduce-scatter, whichever group it runs in. ``by_scope`` files
    each call as the ledger does, {scope: {kind: [calls, bytes]}} (scopes: comm/mesh.py): "world" with plain
    sharding, "shard" for the all-gathers and reduce-scatters inside shard groups and "replica" for the
    all-reduce of each gradient shard across them (hybrid), "reshard" for backward all-gathers inside
    reshard groups (``reshard_after_forward=k``)."""

    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    by_scope: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    all_to_all_calls: float = 0  # whole-tensor optimizers' exchanges (budget/predicted/whole_tensor.py): the bytes one
    all_to_all_bytes: float = 0  # rank sends (a plan: the busiest rank's, budget/predicted/whole_tensor.py)

    @staticmethod
    def of(by_scope: dict[str, dict[str, list[int]]]) -> Traffic:
        """The totals over scopes, from the calls filed by scope."""

        def total(kind: str) -> tuple[int, int]:
            entries = [kinds[kind] for kinds in by_scope.values() if kind in kinds]
            return sum(calls for calls, _ in entries), sum(nbytes for _, nbytes in entries)

        (ag_calls, ag_bytes), (rs_calls, rs_bytes) = total("all_gather"), total("reduce_scatter")
        a2a_calls, a2a_bytes = total("all_to_all")
        return Traffic(ag_calls, ag_bytes, rs_calls, rs_bytes, by_scope, a2a_calls, a2a_bytes)

    def with_exchanges(self, calls: float, nbytes: float) -> Traffic:
        """The same, with the all-to-alls of whole-tensor optimizers (in the world group) added."""
        by_scope = {
            scope: {kind: list(entry) for kind, entry in kinds.items()} for scope, kinds in self.by_scope.items()
        }
        file_call(by_scope, "world", "all_to_all", calls, nbytes)
        return Traffic.of(by_scope)

    def scope_bytes(self, *scopes: str, kind: str | None = None, rings: bool = False) -> int:
        """Bytes filed under any of ``scopes`` (of one ``kind``, or all; ``rings``: all but the all-to-alls,
        whose bytes are what one rank sends, not full tensors)."""
        return sum(nbytes for _, (_, nbytes) in self._entries(scopes, kind, rings))

    def scope_calls(self, *scopes: str, kind: str | None = None, rings: bool = False) -> int:
        """Calls filed under any of ``scopes`` (of one ``kind``, or all; ``rings``: all but the all-to-alls)."""
        return sum(calls for _, (calls, _) in self._entries(scopes, kind, rings))

    def _entries(self, scopes: tuple[str, ...], kind: str | None, rings: bool) -> list[tuple[str, list[int]]]:
        entries = [(k, entry) for s in scopes for k, entry in self.by_scope.get(s, {}).items()]
        return [(k, e) for k, e in entries if kind in (None, k) and not (rings and k == "all_to_all")]


def file_call(by_scope: dict[str, dict[str, list[int]]], scope: str, kind: str, calls: float, nbytes: float) -> None:
    """Add ``calls`` calls moving ``nbytes`` in all to ``by_scope[scope][kind]`` (nothing when no call)."""
    if calls:
        entry = by_scope.setdefault(scope, {}).setdefault(kind, [0, 0])
        entry[0] += calls
        entry[1] += nbytes


def _gathers(
    name: str, last: str | None, stage: Stage, lay: FlatParamLayout, micro: int, reshard: bool
) -> tuple[int, int]:
    """(forward, backward) all-gathers of one flat parameter per optimizer step. Stage 3: before each
    forward, and again before each backward unless the unit stayed gathered (the root, the unit that runs
    forward last, or everything when not resharding after forward). Stages 1-2: once, after the step."""
    if stage is not Stage.PARAMETERS:
        return (1 if lay.requires_grad else 0), 0
    once = name == "root" or not reshard or name == last
    return micro, (0 if once else micro)


def predict_traffic(
    units: dict[str, list[FlatParamLayout]],
    stage: Stage,
    policy: PrecisionPolicy,
    micro_batches: int = 1,
    reduce_every_micro_batch: bool = True,
    reshard_after_forward: bool | int = True,
    *,
    replicas: int = 1,
    reshard_size: int | None = None,
    gather_packing: Packing | None = None,
    reduce_packing: Packing | None = None,
) -> Traffic:
    """Per optimizer step, in the steady state, for a shard group of the layouts' world size among ``replicas``
    such groups: each flat parameter's all-gathers (``_gathers``) and reduce-scatter, and hybrid, the all-reduce of
    its gradient shard across replicas, filed by scope (``Traffic``). Counts the full tensor of each call, the size
    torch's collectives are given. Packed calls (``gather_dtype``, ``reduce_dtype`` 'bf16' / 'fp16' / 'int8':
    comm/packing.py) count their packed bytes, W payloads of a shard each; a packed reduction's shard is fp32
    (summed there), and so is its all-reduce across replicas."""
    by_scope: dict[str, dict[str, list[int]]] = {}
    group = "shard" if replicas > 1 else "world"
    backward_scope = "reshard" if reshard_size is not None and stage is Stage.PARAMETERS else group
    reductions = micro_batches if reduce_every_micro_batch else 1
    others = [name for name in units if name != "root"]
    last = others[-1] if others else None  # the forward order taken as the units' order
    for name, lays in units.items():
        for lay in lays:
            compute = policy.compute_for(lay.dtype).itemsize
            reduce = (policy.reduce_dtype or lay.dtype).itemsize
            floating = lay.dtype.is_floating_point
            exact = lay.padded_numel * compute
            gathered = _packed(gather_packing, lay) if floating and stage is Stage.PARAMETERS else None
            reduced = _packed(reduce_packing, lay) if floating else None
            if lay.world_size > 1:
                forward, backward = _gathers(name, last, stage, lay, micro_batches, bool(reshard_after_forward))
                file_call(by_scope, group, "all_gather", forward, forward * (gathered or exact))
                if backward_scope != group:  # from the group shards: what was gathered, exactly
                    gathered = None
                file_call(by_scope, backward_scope, "all_gather", backward, backward * (gathered or exact))
                if lay.requires_grad:
                    one = reduced or lay.padded_numel * reduce
                    file_call(by_scope, group, "reduce_scatter", reductions, reductions * one)
            if lay.requires_grad and replicas > 1:
                shard = lay.shard_numel * (4 if reduced else reduce)
                file_call(by_scope, "replica", "all_reduce", reductions, reductions * shard)
    return Traffic.of(by_scope)


def _packed(packing: Packing | None, lay: FlatParamLayout) -> int | None:
    """Bytes of one packed call of ``lay`` (every rank's packed shard), or None where it travels as it is."""
    if packing is None or lay.world_size == 1:
        return None
    return lay.world_size * packing.nbytes(lay.shard_numel)


def zero_table_bytes(
    params: float,
    world_size: int,
    stage: Stage,
    mixed: bool = True,
    optimizer: OptimizerShape | None = None,
    itemsize: int = 4,
) -> dict[str, float]:
    """Per-rank bytes by category from a parameter count alone (no layout, no padding): the ZeRO table. ``itemsize``:
    the masters' element (fp32 under mixed precision; a true precision's own: 2 bf16-true, 4 32-true, 8 64-true)."""
    optimizer = optimizer or OptimizerShape()
    p, n = params, world_size
    w, g, m = (2, 2, 4) if mixed else (itemsize, itemsize, 0)
    state = (4 if mixed else itemsize) * optimizer.per_element
    shards = n if stage is Stage.PARAMETERS else 1  # the compute copy's: sharded at stage 3, whole at 1-2
    return {"params": w * p / shards, "grads": g * p / n, "master": m * p / n, "optimizer_state": state * p / n}


@dataclass(frozen=True)
class Interconnect:
    """One rank's link: bytes per second in each direction, the latency of one message, and the compute one call
    takes from its rank (``launch``: posting it, and on a CPU the cores its communication threads take; measured by
    comm/link_probe.py's ``time_busy_call``; 0 where a device queues its calls ahead, as NCCL's stream does).
    ``busy_latency``: a message's latency for a call its rank computed beside while it was pending (the busy probe's
    wait; 0: ``latency``), where calls waited for back to back take ``latency`` (timed in batches)."""

    name: str
    bandwidth: float
    latency: float
    launch: float = 0.0
    busy_latency: float = 0.0

    def busy_extra(self, world_size: int, calls: int = 1, all_reduce: bool = False) -> float:
        """Seconds ``calls`` calls wait beyond their ring bound when their rank computed while they were pending."""
        messages = (2 if all_reduce else 1) * (world_size - 1)
        return calls * messages * max(self.busy_latency - self.latency, 0.0)

    def ring_seconds(self, nbytes: float, world_size: int, calls: int = 1) -> float:
        """Lower bound for ``calls`` ring all-gathers / reduce-scatters of ``nbytes`` full tensors in all:
        each rank sends and receives (N-1)/N of them, in N-1 messages per call."""
        n = world_size
        return (n - 1) / n * nbytes / self.bandwidth + calls * (n - 1) * self.latency

    def exchange_seconds(self, nbytes: float, calls: int = 1) -> float:
        """Lower bound for ``calls`` all-to-alls in which one rank sends ``nbytes`` in all: its link carries
        them at full bandwidth, its messages of one call in flight together (one latency)."""
        return nbytes / self.bandwidth + calls * self.latency if nbytes else 0.0

    def all_reduce_seconds(self, nbytes: float, world_size: int, calls: int = 1) -> float:
        """Lower bound for ``calls`` ring all-reduces of ``nbytes`` in all (a reduce-scatter, then an
        all-gather): each rank sends and receives 2 (N-1)/N of them, in 2 (N-1) messages per call."""
        n = world_size
        return 2 * (n - 1) / n * nbytes / self.bandwidth + calls * 2 * (n - 1) * self.latency


@dataclass(frozen=True)
class Links:
    """The link inside shard groups and the link across them, and how the ranks are grouped."""

    intra: Interconnect
    inter: Interconnect
    replicas: int = 1  # R shard groups
    reshard_size: int | None = None  # k: backward gathers in reshard groups of k ranks
    group: int | None = None  # G: the ranks of a shard group (``link_seconds``; step_time.py reads each layout's)

    @staticmethod
    def of_mesh(mesh: Any, intra: Interconnect, inter: Interconnect) -> Links:
        """A run's groups (comm/mesh.py's ``Mesh``) on ``intra`` inside its shard groups and ``inter`` across them."""
        reshard = mesh.reshard.world_size if mesh.regrouped else None
        return Links(intra, inter, mesh.replica.world_size, reshard, mesh.shard.world_size)


def link_seconds(traffic: Traffic, links: Links, whole: WholePlan | None = None) -> dict[str, float]:
    """Ring lower bounds per link. Intra: the shard groups' all-gathers and reduce-scatters at G ranks (the reshard
    groups' at k); inter: the all-reduces of gradient shards across the R replicas. A whole-tensor optimizer's
    all-to-alls (budget/predicted/whole_tensor.py): what the busiest rank sends inside its shard group, and across."""
    intra, inter, k = links.intra, links.inter, links.reshard_size

    def ring(scopes: tuple[str, ...], ranks: int) -> float:
        nbytes, calls = traffic.scope_bytes(*scopes, rings=True), traffic.scope_calls(*scopes, rings=True)
        return intra.ring_seconds(nbytes, ranks, calls)

    inside = ring(("world", "shard"), links.group) + (ring(("reshard",), k) if k else 0.0)
    across = inter.all_reduce_seconds(traffic.scope_bytes("replica"), links.replicas, traffic.scope_calls("replica"))
    if whole is not None:
        ranks = range(len(whole.state))
        inside += intra.exchange_seconds(max(whole.sent(r) - whole.across[r] for r in ranks), whole.calls)
        across += inter.exchange_seconds(max(whole.across), whole.calls)
    return {"intra": inside, "inter": across}


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
