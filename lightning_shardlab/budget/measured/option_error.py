"""The error each fewer-bytes option brings, per unit (docs/slow_links.md): measured on the run's own tensors.

- int8 weight gathers (``gather_dtype='int8'``): every rank computes with each rank's compute shard packed and
  unpacked (comm/packed_collectives.py ``all_gather_packed``). That is set against the fp32 masters, element by
  element, on the real elements of this rank's shard, as fit ends.
- packed reductions (``reduce_dtype`` 'bf16' / 'fp16' / 'int8'): the reduced gradient against an exact fp32
  reduction of the same gradients, one optimizer step in ``every`` (sharding/reduce_sample.py).

Each rank keeps sums over its own shards: ``[squared error, squared reference, max |error|]`` by unit
(sharding/packing_error.py, where the vitals take theirs from too). Rank 0 combines them over every rank's report
(``combine``), which the reports are gathered for anyway: no collective here. Relative L2 is
``sqrt(sum of squared error / sum of squared reference)`` over the unit's elements on all ranks.
"""

from __future__ import annotations

from typing import Any

from lightning_shardlab.sharding.packing_error import combine


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
