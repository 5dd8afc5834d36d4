"""The plan's arithmetic: a run's budget before it runs, from a parameter count or a real model's layout.

``plan_params`` applies the ZeRO table to a parameter count; ``plan_model`` lays a real model out into its
units at the target world size on the meta device (no memory, no processes) and predicts from that layout,
as ``ShardLabBudget`` does for a run (budget/predict.py, budget/tiers.py). Both return a ``Plan``: bytes per
rank by category, bytes moved per step, and the lower-bound time on the links. ``shardlab plan`` (the
command, its inputs and its printing) is budget/plan_command.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_shardlab.budget.predict import (
    Interconnect,
    OptimizerShape,
    Traffic,
    file_call,
    predict_gathered_peak,
    predict_memory,
    predict_traffic,
    zero_table_bytes,
)
from lightning_shardlab.budget.tiers import (
    plan_fields,
    predict_locations,
    predict_moves,
    split_by_tier,
)
from lightning_shardlab.core.config import DTYPES, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.policy import plan_units

COMPUTE = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": None}


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
    fits: bool | None = None

    @property
    def model_state(self) -> float:
        return sum(v for k, v in self.memory_per_rank.items() if k != "padding")


def link_seconds(
    traffic: Traffic, group: int, reshard: int | None, replicas: int, intra: Interconnect, inter: Interconnect
) -> dict[str, float]:
    """Ring lower bounds per link. Intra: the shard groups' all-gathers and reduce-scatters at G ranks (and
    the reshard groups' at k): (N-1)/N of every full tensor crosses, plus N-1 latencies per call. Inter: the
    all-reduces of gradient shards across the R replicas: 2 (R-1)/R of every shard, 2 (R-1) latencies."""

    def ring(scopes: tuple[str, ...], ranks: int) -> float:
        return intra.ring_seconds(traffic.scope_bytes(*scopes), ranks, traffic.scope_calls(*scopes))

    inside = ring(("world", "shard"), group) + (ring(("reshard",), reshard) if reshard else 0.0)
    across = inter.all_reduce_seconds(traffic.scope_bytes("replica"), replicas, traffic.scope_calls("replica"))
    return {"intra": inside, "inter": across}


def _groups(
    traffic: Traffic, group: int, reshard: int | None, replicas: int, intra: Interconnect, inter: Interconnect
) -> dict[str, Any]:
    """The Plan fields that say how the ranks are grouped, and the time on each link."""
    seconds = link_seconds(traffic, group, reshard, replicas, intra, inter)
    return {
        "traffic": vars(traffic),
        "shard_group_size": group,
        "replicas": replicas,
        "reshard_size": reshard,
        "interconnect": intra.name,
        "links": {"intra": intra.name, "inter": inter.name},
        "link_seconds": seconds,
        "comm_seconds": sum(seconds.values()),
    }


def zero_traffic(
    params: float, stage: Stage, precision: str, group: int, reshard: int | None, replicas: int
) -> Traffic:
    """From a parameter count: one call per collective kind and pass (no layout, no padding). Stage 3
    gathers before forward and again before backward (inside the reshard group with k); stages 1-2 after the
    step; one reduce-scatter, and, hybrid, one all-reduce of its shard (1/G of it) across the replicas."""
    mixed = COMPUTE[precision] is not None
    w = 2 if mixed or precision == "bf16-true" else 4
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
    mixed = COMPUTE[precision] is not None
    shape = OptimizerShape.named(optimizer)
    memory = zero_table_bytes(params, group, stage, mixed, shape)
    if offload == "cpu" and not mixed:
        memory["master"] = 4 * params / group  # the host keeps a master of its own beside the device's shard
    per_element = shape.per_element * 4 + (4 if mixed else 0)
    moves = {
        "none": {"down": 0.0, "up": 0.0},
        "cpu": {"down": 4 * params / group, "up": (2 if mixed else 4) * params / group},
        "disk": {"down": per_element * params / group, "up": per_element * params / group},
    }[offload]
    unsharded = sum(zero_table_bytes(params, 1, Stage.PARAMETERS, mixed, shape).values())
    replicas = world_size // group
    traffic = zero_traffic(params, stage, precision, group, reshard, replicas)
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
        **_groups(traffic, group, reshard, replicas, link, inter or link),
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
    replicas = world_size // group
    units = plan_units(model, config, group).layouts()
    layouts = [lay for lays in units.values() for lay in lays]
    policy = PrecisionPolicy(COMPUTE[precision], DTYPES[config.reduce_dtype] if config.reduce_dtype else None)
    shape = OptimizerShape.named(optimizer)
    offload = config.offload if config.offload != "auto" else "cpu"
    in_group = [predict_memory(layouts, config.stage, policy, r, shape, offload) for r in range(min(group, 64))]
    per_rank = [in_group[r % group] for r in range(min(world_size, 64))]
    fullest = max(in_group, key=lambda m: sum(m.values()))
    r = in_group.index(fullest)
    locations = predict_locations(layouts, config.stage, policy, r, shape, offload, "host")
    single = [lay for lays in plan_units(model, config, 1).layouts().values() for lay in lays]
    unsharded = sum(v for k, v in predict_memory(single, Stage.PARAMETERS, policy, 0, shape).items() if k != "padding")
    traffic = predict_traffic(
        units,
        config.stage,
        policy,
        reshard_after_forward=config.reshard_after_forward,
        replicas=replicas,
        reshard_size=reshard,
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
        gathered_peak=(peak := predict_gathered_peak(units, config.stage, policy, reshard)),
        **_groups(traffic, group, reshard, replicas, link, inter or link),
        **plan_fields(
            locations, predict_moves(layouts, policy, offload, shape, r), offload, tier_link, device_memory, peak
        ),
    )
