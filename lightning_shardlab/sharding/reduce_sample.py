"""A packed reduction's error, sampled: the same gradients reduced exactly beside it, once in a while.

``reduce_dtype`` 'bf16' / 'fp16' / 'int8' (docs/slow_links.md) sends each rank's gradient in fewer bytes. To show
what that costs, the budget (``ShardLabBudget(error_every=K)``) sets a ``ReduceSample`` on every unit for one
optimizer step in K. During that step each packed reduce-scatter is preceded by an exact one of the same flat
gradient in fp32, in the same group (one extra reduce-scatter per flat parameter, filed in the ledger under the label
``EXACT_LABEL``, not under the flat parameter's name). When the packed one lands, its shard is set against the exact
shard. Each rank keeps sums of its own shard (squared error, squared exact value, largest difference) by unit; the
budget combines them over ranks (budget/measured/option_error.py). The exact shard is only compared, never used: the
step trains on the packed result, as every other step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.sharding.flat_param import FlatParam

EXACT_LABEL = "exact reduction (error sample)"


class ReduceSample:
    """One sampled optimizer step's comparisons: ``sums[unit] = [squared error, squared exact, max |error|]``."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}
        self._exact: dict[int, Tensor] = {}  # id(flat parameter) -> its exact shard, until the packed one lands

    def reduce_exactly(self, fp: FlatParam, flat: Tensor, group: Comm) -> None:
        """Every rank of ``group``, before the packed call: the exact mean of ``flat`` in fp32, this rank's shard."""
        exact = torch.empty(fp.layout.shard_numel, dtype=torch.float32, device=flat.device)
        collectives.reduce_scatter(exact, flat.float(), group, label=EXACT_LABEL)
        self._exact[id(fp)] = exact

    def compare(self, unit: str, fp: FlatParam, reduced: Tensor) -> None:
        """The packed call's shard has landed: add its difference from the exact shard to ``unit``'s sums."""
        exact = self._exact.pop(id(fp), None)
        if exact is None:
            return
        error = reduced.float() - exact
        sums = self.sums.setdefault(unit, [0.0, 0.0, 0.0])
        sums[0] += float(error.square().sum())
        sums[1] += float(exact.square().sum())
        sums[2] = max(sums[2], float(error.abs().max())) if error.numel() else sums[2]
