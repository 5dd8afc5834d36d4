"""The fewer-bytes options, planned: each one's bytes per step, and the communication time it saves on the plan's
links (``shardlab plan``, docs/slow_links.md).

The plan's own arithmetic: the real layout's traffic (zero_table.py ``predict_traffic``, with comm/packing.py's
packings) on the plan's links (zero_table.py ``link_seconds``). Each option is planned alone against the exact run
(``reduce_dtype`` and ``gather_dtype`` off, the other options as given), then both int8 options together. A saving is
a lower bound's difference: packing and unpacking cost compute, not counted here (docs/slow_links.md measures it).
``ShardLabBudget`` sets the same rows on the link the run measured for itself (``run_option_savings``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from lightning_shardlab.budget.predicted.zero_table import Interconnect, Links, link_seconds, predict_traffic
from lightning_shardlab.comm.packing import packing_for
from lightning_shardlab.core.config import Accumulation, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.sharded_model import ShardedModel

if TYPE_CHECKING:
    from lightning_shardlab.budget.predicted.whole_tensor import WholePlan

OPTIONS = (  # (what the table calls it, the options it sets)
    ("reduce_dtype='bf16'", {"reduce_dtype": "bf16"}),
    ("reduce_dtype='int8'", {"reduce_dtype": "int8"}),
    ("gather_dtype='int8'", {"gather_dtype": "int8"}),
    ("gather_dtype='int8' + reduce_dtype='int8'", {"gather_dtype": "int8", "reduce_dtype": "int8"}),
)


def option_savings(
    units: dict[str, list[FlatParamLayout]],
    config: ShardLabConfig,
    compute: torch.dtype | None,
    links: Links,
    whole: WholePlan | None = None,
    *,
    micro_batches: int = 1,
    reduce_every_micro_batch: bool = True,
) -> list[dict[str, Any]]:
    """Rows: the exact run first, then each option that applies (int8 gathers: stage 3 only), each with its
    ``bytes`` moved per step (what travels in the rings, full tensors), ``comm_seconds`` (the plan's lower bound on
    ``links``, ``link_seconds``, a whole-tensor optimizer's exchanges included) and ``saved_seconds`` against the
    exact run (gradients reduced in their masters' dtype). A run's micro-batches per step, and whether each reduces,
    may be given."""
    policy = PrecisionPolicy(compute, None)

    def row(name: str, options: dict[str, str]) -> dict[str, Any]:
        traffic = predict_traffic(
            units, config.stage, policy, micro_batches, reduce_every_micro_batch,
            reshard_after_forward=config.reshard_after_forward, replicas=links.replicas,
            reshard_size=links.reshard_size,
            gather_packing=packing_for(options.get("gather_dtype"), config.quant_block_size),
            reduce_packing=packing_for(options.get("reduce_dtype"), config.quant_block_size),
        )  # fmt: skip
        moved = traffic.scope_bytes(*traffic.by_scope, rings=True)
        return {"option": name, "bytes": moved, "comm_seconds": sum(link_seconds(traffic, links, whole).values())}

    rows = [row("exact", {})]
    for name, options in OPTIONS:
        if "gather_dtype" in options and config.stage is not Stage.PARAMETERS:
            continue  # weights stay resident at stages 1-2: nothing to gather per unit
        rows.append(row(name, options))
    for each in rows:
        each["saved_seconds"] = rows[0]["comm_seconds"] - each["comm_seconds"]
    return rows


def run_option_savings(
    sharded: ShardedModel, micro_batches: int, intra: Interconnect, inter: Interconnect
) -> dict[str, Any]:
    """``option_savings`` for a run (``ShardLabBudget``): its units in the order their forward ran, its options and
    compute dtype, its micro-batches per step and its groups, timed on the links it probed for itself (``intra``
    inside its shard groups, ``inter`` across them) as the plan times its own. ``rows`` say which is the run's own
    choice (``this_run``)."""
    mesh, config = sharded.mesh, sharded.config
    units = {u.name: [fp.layout for fp in u.flat_params] for u in sharded.forward_order}
    links = Links.of_mesh(mesh, intra, inter)
    rows = option_savings(
        units, config, sharded.policy.compute_dtype, links,
        micro_batches=micro_batches,
        reduce_every_micro_batch=config.accumulation is Accumulation.REDUCE,
    )  # fmt: skip
    chosen = {k: v for k in ("reduce_dtype", "gather_dtype") if packing_for(v := getattr(config, k)) is not None}
    mine = next((name for name, options in OPTIONS if options == chosen), None if chosen else "exact")
    for row in rows:
        row["this_run"] = row["option"] == mine  # a run with another option (fp16 reductions) has no row of its own
    return {"link": asdict(intra), "inter": asdict(inter) if links.replicas > 1 else None, "rows": rows}
