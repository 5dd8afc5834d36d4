"""The plan's arithmetic: a run's budget before it runs, from a parameter count or a real model's layout.

``plan_params`` applies the ZeRO table to a parameter count; ``plan_model`` lays a real model out into its units at
the target world size on the meta device (no memory, no processes) and predicts from that layout as
``ShardLabBudget`` does for a run (budget/predicted/zero_table.py, budget/measured/tiers.py). Both return a ``Plan``:
bytes per rank by category, bytes moved per step, the lower-bound time on the links, and a whole-tensor optimizer's
owners and exchanges (budget/predicted/whole_tensor.py). ``shardlab plan`` reads its inputs and prints it (cli/).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_shardlab.budget.measured.tiers import plan_fields, predict_locations, predict_moves, split_by_tier
from lightning_shardlab.budget.predicted.engine_schedule import Schedule, gathered_peak
from lightning_shardlab.budget.predicted.option_savings import option_savings
from lightning_shardlab.budget.predicted.whole_tensor import SHOWN, WholePlan, plan_whole_model, plan_whole_params
from lightning_shardlab.budget.predicted.zero_table import (
    Interconnect,
    Links,
    OptimizerShape,
    Traffic,
    file_call,
    link_seconds,
    predict_memory,
    predict_traffic,
    zero_table_bytes,
)
from lightning_shardlab.comm.packing import packing_for
from lightning_shardlab.core.config import REDUCE_DTYPES, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.optimizer import whole_tensor_class
from lightning_shardlab.sharding.policy import plan_units

COMPUTE = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": None, "64-true": None}
# a true precision's element (parameters, gradients, masters and optimizer state in it); mixed: fp32 masters
ELEMENT_BYTES = {"32-true": 4, "bf16-true": 2, "64-true": 8, "bf16-mixed": 4, "16-mixed": 4}


@dataclass
class Plan:
    source: str
    params: int
    world_size: int
    stage: int
    precision: str
    memory_per_rank: dict[str, float]  # the fullest rank's bytes by category (sharded over its shard group)
    per_rank: list[dict[str, float]]  # every rank's (up to 64), for comparing with a real run
    unsharded_bytes: float  # model state on one device (DDP)
    gathered_peak: int
    traffic: dict[str, Any]  # per optimizer step, full-tensor bytes; by_scope: {scope: {kind: [calls, bytes]}}
    shard_group_size: int  # G: the ranks that shard the model between them (the world, unless hybrid)
    replicas: int  # R = world_size / G shard groups, each a replica of the others
    reshard_size: int | None  # k: backward all-gathers inside reshard groups of k ranks (reshard_after_forward=k)
    interconnect: str  # the link inside shard groups (every link, unless hybrid)
    links: dict[str, str]  # {"intra": the link inside shard groups, "inter": the link across them}
    link_seconds: dict[str, float]  # lower bound on each link
    comm_seconds: float  # their sum
    compute_seconds: float | None = None
    offload: str = "none"  # where masters and optimizer state live: none, cpu (host memory) or disk
    locations: dict[str, dict[str, float]] | None = None  # {tier: {category: bytes}} of the fullest rank
    tier_moves: dict[str, float] | None = None  # bytes per step to ("down") and from ("up") the offload tier
    tier_link: str = ""
    tier_seconds: float = 0.0  # lower bound for those moves on tier_link
    device_bytes: float = 0.0  # device-resident model state + gathered units at their peak
    device_memory: float | None = None  # --device-memory, bytes
    fits: bool | None = None  # device_bytes fit; with a traced micro-batch, the step peak (budget/predicted/changes.py)
    whole_tensor: dict[str, Any] | None = None  # a whole-tensor optimizer's owners (WholePlan.fields)
    activations: dict[str, Any] | None = None  # one micro-batch traced (ActivationTrace.fields, + checkpointing)
    step_peak: dict[str, Any] | None = None  # state + the step's busiest moment, bytes (fits.PlannedPeak)
    fit: dict[str, Any] | None = None  # --device-memory with a micro-batch: the verdict, the changes tried
    options: list[dict[str, Any]] | None = None  # each fewer-bytes option's time saved per step (option_savings.py)

    @property
    def model_state(self) -> float:
        return sum(v for k, v in self.memory_per_rank.items() if k != "padding")


def _groups(traffic: Traffic, links: Links, whole: WholePlan | None = None) -> dict[str, Any]:
    """The Plan fields that say how the ranks are grouped, the time on each link, and a whole-tensor
    optimizer's exchanges (added to the traffic as all_to_all: the busiest rank's bytes) and owners."""
    seconds = link_seconds(traffic, links, whole)
    if whole is not None:
        traffic = traffic.with_exchanges(whole.calls, max(whole.sent(r) for r in range(len(whole.state))))
    return {
        "whole_tensor": whole.fields() if whole is not None else None,
        "traffic": vars(traffic),
        "shard_group_size": links.group,
        "replicas": links.replicas,
        "reshard_size": links.reshard_size,
        "interconnect": links.intra.name,
        "links": {"intra": links.intra.name, "inter": links.inter.name},
        "link_seconds": seconds,
        "comm_seconds": sum(seconds.values()),
    }


def _optimizer(name: str, offload: str) -> tuple[type[Optimizer] | None, OptimizerShape | None]:
    """(the whole-tensor optimizer class ``name`` names, else None; the elementwise one's shape, else None).
    ``ValueError`` for an unknown name, or a whole-tensor optimizer with offload (a run refuses it too)."""
    cls = whole_tensor_class(name)
    if cls is None:
        return None, OptimizerShape.named(name)
    if offload != "none":
        raise ValueError(
            f"--optimizer {name} steps whole parameters on their owner ranks, which is not built for"
            f" offload={offload!r}. HINT: --offload none."
        )
    return cls, None


def zero_traffic(
    params: float, stage: Stage, precision: str, group: int, reshard: int | None, replicas: int
) -> Traffic:
    """From a parameter count: one call per collective kind and pass (no layout, no padding). Stage 3
    gathers before forward and again before backward (inside the reshard group with k); stages 1-2 after the
    step; one reduce-scatter, and, hybrid, one all-reduce of its shard (1/G of it) across the replicas."""
    mixed = COMPUTE[precision] is not None
    w = 2 if mixed else ELEMENT_BYTES[precision]
    r = 4 if mixed else w  # gradients reduce in fp32 under mixed precision
    scope = "shard" if replicas > 1 else "world"
    by_scope: dict[str, dict[str, list[int]]] = {}
    if group > 1:
        file_call(by_scope, scope, "all_gather", 1, int(w * params))
        if stage is Stage.PARAMETERS:
            file_call(by_scope, "reshard" if reshard else scope, "all_gather", 1, int(w * params))
        file_call(by_scope, scope, "reduce_scatter", 1, int(r * params))
    if replicas > 1:
        file_call(by_scope, "replica", "all_reduce", 1, int(r * params / group))
    return Traffic.of(by_scope)


def plan_params(
    params: float,
    world_size: int,
    stage: Stage,
    precision: str,
    optimizer: str,
    link: Interconnect,
    *,
    inter: Interconnect | None = None,
    config: ShardLabConfig | None = None,
    per_node: int | None = None,
    offload: str = "none",
    tier_link: str | None = None,
    device_memory: float | None = None,
) -> Plan:
    """From a parameter count: the ZeRO table at N = G, the shard group size of ``config`` (its
    ``shard_group_size`` and ``reshard_after_forward``; default: the world shards the model), ``link`` inside
    shard groups, ``inter`` (default ``link``) across them. Raises ``ValueError`` naming the option unless
    the groups tile the world."""
    config = config or ShardLabConfig(stage=stage)
    group, reshard = config.group_sizes(world_size, per_node or world_size)
    mixed, itemsize = COMPUTE[precision] is not None, ELEMENT_BYTES[precision]  # the master's element
    cls, named = _optimizer(optimizer, offload)
    shape = named or OptimizerShape(0, 0)  # a whole-tensor optimizer's state: from its owners, below
    memory = zero_table_bytes(params, group, stage, mixed, shape, itemsize)
    whole = alone = None
    if cls is not None:
        whole = plan_whole_params(params, world_size, group, cls, itemsize, stage is Stage.PARAMETERS or mixed)
        memory["optimizer_state"] = whole.optimizer_state(0)
        alone = plan_whole_params(params, 1, 1, cls, itemsize, False)
    if offload == "cpu" and not mixed:
        memory["master"] = itemsize * params / group  # the host keeps a master of its own beside the device's shard
    per_element = shape.per_element * itemsize + (4 if mixed else 0)
    moves = {
        "none": {"down": 0.0, "up": 0.0},
        "cpu": {"down": itemsize * params / group, "up": (2 if mixed else itemsize) * params / group},
        "disk": {"down": per_element * params / group, "up": per_element * params / group},
    }[offload]
    unsharded = sum(zero_table_bytes(params, 1, Stage.PARAMETERS, mixed, shape, itemsize).values())
    unsharded += alone.optimizer_state(0) if alone is not None else 0
    links = Links(link, inter or link, world_size // group, reshard, group)
    traffic = zero_traffic(params, stage, precision, group, reshard, links.replicas)
    return Plan(
        source="parameter count (ZeRO table)",
        params=int(params),
        world_size=world_size,
        stage=int(stage),
        precision=precision,
        memory_per_rank={**memory, "padding": 0.0},
        per_rank=[],
        unsharded_bytes=unsharded,
        gathered_peak=0,
        **_groups(traffic, links, whole),
        **plan_fields(split_by_tier(memory, offload, mixed), moves, offload, tier_link, device_memory, 0),
    )


def plan_model(
    model: torch.nn.Module,
    config: ShardLabConfig,
    world_size: int,
    precision: str,
    optimizer: str,
    link: Interconnect,
    source: str,
    *,
    inter: Interconnect | None = None,
    per_node: int | None = None,
    tier_link: str | None = None,
    device_memory: float | None = None,
) -> Plan:
    """From a real (meta-device) model: its unit layout at the shard group size G (``config.group_sizes``: the
    world unless hybrid), the same arithmetic the ledger sets against what a run measures. Rank r holds what
    rank r mod G of its shard group holds."""
    group, reshard = config.group_sizes(world_size, per_node or world_size)
    links = Links(link, inter or link, world_size // group, reshard, group)
    units = plan_units(model, config, group).layouts()
    layouts = [lay for lays in units.values() for lay in lays]
    policy = plan_policy(precision, config)
    offload = config.offload if config.offload != "auto" else "cpu"
    cls, shape = _optimizer(optimizer, offload)
    whole = plan_whole_model(units, config.stage, policy, world_size, group, cls) if cls is not None else None
    per_rank, fullest, r = _memory(layouts, config.stage, policy, shape, offload, group, world_size, whole)
    locations = predict_locations(layouts, config.stage, policy, r, shape, offload, "host")
    if whole is not None:  # its state lives on the device (no offload)
        locations["device"]["optimizer_state"] += fullest["optimizer_state"]
    unsharded = _unsharded(model, config, policy, shape, cls)
    traffic = predict_traffic(
        units,
        config.stage,
        policy,
        reshard_after_forward=config.reshard_after_forward,
        replicas=links.replicas,
        reshard_size=reshard,
        gather_packing=packing_for(config.gather_dtype, config.quant_block_size),
        reduce_packing=packing_for(config.reduce_dtype, config.quant_block_size),
    )
    return Plan(
        source=source,
        params=sum(lay.numel for lay in layouts),
        world_size=world_size,
        stage=int(config.stage),
        precision=precision,
        memory_per_rank=fullest,
        per_rank=per_rank,
        unsharded_bytes=unsharded,
        gathered_peak=(peak := gathered_peak(units, policy, Schedule.of(config), reshard)),
        # each option timed on this plan's links as its own traffic (the exchanges: the same in each)
        options=option_savings(units, config, policy.compute_dtype, links, whole),
        **_groups(traffic, links, whole),
        **plan_fields(
            locations, predict_moves(layouts, policy, offload, shape, r), offload, tier_link, device_memory, peak
        ),
    )


def _unsharded(
    model: torch.nn.Module,
    config: ShardLabConfig,
    policy: PrecisionPolicy,
    shape: OptimizerShape | None,
    cls: type[Optimizer] | None,
) -> float:
    """The model state on one device (DDP): the layout of a world of 1, a whole-tensor optimizer's state all there."""
    units = plan_units(model, config, 1).layouts()
    alone = predict_memory([lay for lays in units.values() for lay in lays], Stage.PARAMETERS, policy, 0, shape)
    if cls is not None:
        alone["optimizer_state"] = plan_whole_model(units, Stage.PARAMETERS, policy, 1, 1, cls).optimizer_state(0)
    return sum(v for k, v in alone.items() if k != "padding")


def _memory(
    layouts: list[FlatParamLayout],
    stage: Stage,
    policy: PrecisionPolicy,
    shape: OptimizerShape | None,
    offload: str,
    group: int,
    world_size: int,
    whole: WholePlan | None,
) -> tuple[list[dict[str, float]], dict[str, float], int]:
    """(the first 64 ranks' bytes by category, the fullest rank's, its position in its shard group). Rank r
    holds what position r mod G holds, but for a whole-tensor optimizer's state, which is its owners'."""
    if whole is None:
        in_group = [predict_memory(layouts, stage, policy, r, shape, offload) for r in range(min(group, SHOWN))]
        fullest = max(in_group, key=lambda m: sum(m.values()))
        return [in_group[r % group] for r in range(min(world_size, SHOWN))], fullest, in_group.index(fullest)
    at = functools.cache(lambda position: predict_memory(layouts, stage, policy, position, None, offload))
    everyone = [{**at(r % group), "optimizer_state": whole.optimizer_state(r)} for r in range(world_size)]
    fullest = max(everyone, key=lambda m: sum(m.values()))
    return everyone[:SHOWN], fullest, everyone.index(fullest) % group


def plan_policy(precision: str, config: ShardLabConfig) -> PrecisionPolicy:
    """What a run in ``precision`` with ``config``'s ``reduce_dtype`` computes and reduces in."""
    return PrecisionPolicy(COMPUTE[precision], REDUCE_DTYPES[config.reduce_dtype] if config.reduce_dtype else None)
