"""The fewer-bytes options, planned: each one's bytes per step, and the communication time it saves on the plan's
links (``shardlab plan``, docs/slow_links.md).

The same arithmetic as the plan itself: the traffic of the real layout (zero_table.py ``predict_traffic``, with
the packings of comm/packing.py) set on the plan's links (plan.py ``link_seconds``). Each option is planned alone
against the exact run (``reduce_dtype`` and ``gather_dtype`` off, the plan's other options as given), and then both
int8 options together. A saving is a lower bound's difference: packing and unpacking cost compute time, which is
not counted here (docs/slow_links.md measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_shardlab.budget.predicted.zero_table import Traffic, predict_traffic
from lightning_shardlab.comm.packing import packing_for
from lightning_shardlab.core.config import PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout

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
    replicas: int,
    reshard: int | None,
    seconds_of: Callable[[Traffic], float],
) -> list[dict[str, Any]]:
    """Rows: the exact run first, then each option that applies (int8 gathers: stage 3 only), each with its
    ``bytes`` moved per step (what travels in the rings, full tensors), ``comm_seconds`` (``seconds_of`` its
    traffic: the plan's lower bound on its links) and ``saved_seconds`` against the exact run."""
    rows = [_row("exact", {}, units, config, compute, replicas, reshard, seconds_of)]
    for name, options in OPTIONS:
        if "gather_dtype" in options and config.stage is not Stage.PARAMETERS:
            continue  # weights stay resident at stages 1-2: nothing to gather per unit
        rows.append(_row(name, options, units, config, compute, replicas, reshard, seconds_of))
    for row in rows:
        row["saved_seconds"] = rows[0]["comm_seconds"] - row["comm_seconds"]
    return rows


def _row(
    name: str,
    options: dict[str, str],
    units: dict[str, list[FlatParamLayout]],
    config: ShardLabConfig,
    compute: torch.dtype | None,
    replicas: int,
    reshard: int | None,
    seconds_of: Callable[[Traffic], float],
) -> dict[str, Any]:
    traffic = predict_traffic(
        units,
        config.stage,
        PrecisionPolicy(compute, None),
        reshard_after_forward=config.reshard_after_forward,
        replicas=replicas,
        reshard_size=reshard,
        gather_packing=packing_for(options.get("gather_dtype"), config.quant_block_size),
        reduce_packing=packing_for(options.get("reduce_dtype"), config.quant_block_size),
    )
    moved = traffic.scope_bytes(*traffic.by_scope, rings=True)
    return {"option": name, "bytes": moved, "comm_seconds": seconds_of(traffic)}
