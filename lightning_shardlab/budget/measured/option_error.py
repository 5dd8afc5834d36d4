"""The error each fewer-bytes option brings, per unit (docs/slow_links.md): measured on the run's own tensors.

- int8 weight gathers (``gather_dtype='int8'``): every rank computes with each rank's compute shard packed and
  unpacked (comm/collectives.py ``all_gather_packed``). That is set against the fp32 masters, element by element,
  on the real elements of this rank's shard, as fit ends.
- packed reductions (``reduce_dtype`` 'bf16' / 'fp16' / 'int8'): the reduced gradient against an exact fp32
  reduction of the same gradients, one optimizer step in ``every`` (sharding/reduce_sample.py).

Each rank keeps sums over its own shards: ``[squared error, squared reference, max |error|]`` by unit. Rank 0
combines them over every rank's report (``combine``), which the reports are gathered for anyway: no collective
here. Relative L2 is ``sqrt(sum of squared error / sum of squared reference)`` over the unit's elements on all ranks.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_shardlab.sharding.sharded_model import ShardedModel


def gather_error_sums(sharded: ShardedModel) -> dict[str, list[float]]:
    """By unit: this rank's real shard elements as every rank computes with them (packed, then unpacked) against
    its masters. Empty unless ``gather_dtype`` packs some flat parameter across ranks."""
    sums: dict[str, list[float]] = {}
    for unit in sharded.forward_order:
        for fp in unit.flat_params:
            if fp.gather_packing is None or fp.layout.world_size == 1:
                continue
            real = fp.layout.shard_numel - fp.layout.padding_in_shard(fp.rank)
            shard = fp.shard.detach()
            gathered = fp.gather_packing.unpack(fp.gather_packing.pack(shard), shard.new_empty(shard.shape))
            master = fp.master.detach()[:real].float()
            error = gathered[:real].float() - master
            unit_sums = sums.setdefault(unit.name, [0.0, 0.0, 0.0])
            unit_sums[0] += float(error.square().sum())
            unit_sums[1] += float(master.square().sum())
            unit_sums[2] = max(unit_sums[2], float(error.abs().max())) if real else unit_sums[2]
    return sums


def combine(per_rank: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """By unit, over every rank's sums: ``max_abs`` (the largest difference of any element) and ``rel_l2``."""
    out: dict[str, dict[str, float]] = {}
    for sums in per_rank:
        for unit, (err, ref, largest) in sums.items():
            entry = out.setdefault(unit, {"err_sq": 0.0, "ref_sq": 0.0, "max_abs": 0.0})
            entry["err_sq"] += err
            entry["ref_sq"] += ref
            entry["max_abs"] = max(entry["max_abs"], largest)
    return {
        unit: {"max_abs": e["max_abs"], "rel_l2": math.sqrt(e["err_sq"] / e["ref_sq"]) if e["ref_sq"] else 0.0}
        for unit, e in out.items()
    }


def option_error(everyone: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's figures for the JSON and the table, from every rank's ``option_error_sums``: ``gather`` by unit,
    and ``reduce``: each sampled step's figures by unit (``steps``: the optimizer steps sampled). Empty with the
    defaults."""
    mine = [r.get("option_error_sums") or {} for r in everyone]
    out: dict[str, Any] = {}
    if any(m.get("gather") for m in mine):
        out["gather"] = combine([m.get("gather", {}) for m in mine])
    samples = [m.get("reduce", []) for m in mine]
    if any(samples):
        steps = [step for step, _ in samples[0]]
        out["reduce"] = {
            "every": mine[0].get("reduce_every"),
            "steps": steps,
            "by_step": [combine([s[i][1] for s in samples]) for i in range(len(steps))],
        }
    return out
