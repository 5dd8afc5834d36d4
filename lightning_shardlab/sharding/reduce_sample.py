"""A packed reduction's error, sampled: the same gradients reduced exactly beside it, once in a while.

``reduce_dtype`` 'bf16' / 'fp16' / 'int8' (docs/slow_links.md) sends each rank's gradient in fewer bytes. To show
what that costs, a ``ReduceSample`` is set on every unit for one optimizer step: by the budget one step in K
(``ShardLabBudget(error_every=K)``), by the vitals on their logged steps (``ShardLabVitals``). During that step each
packed reduce-scatter is preceded by an exact one of the same flat gradient in fp32, in the same group (one extra
reduce-scatter per flat parameter, filed in the ledger under the label ``EXACT_LABEL``, not under the flat
parameter's name). When the packed one lands, its shard is set against the exact shard. Each rank keeps sums of its
own shard (sharding/packing_error.py: squared error, squared exact value, largest difference) by unit, on the
device; the callbacks combine them over ranks. The exact shard is only compared, never used: the step trains on the
packed result, as every other step does.

A unit holds one sample at a time: a callback that samples a step another one samples already ``join``s its sample
(one exact reduction serves both), and the sample is taken off the units when the last of them ``leave``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.packing_error import add_sums, as_lists, error_sums

EXACT_LABEL = "exact reduction (error sample)"


class ReduceSample:
    """One sampled optimizer step's comparisons: ``totals[unit]`` = [squared error, squared exact, max |error|]."""

    def __init__(self) -> None:
        self.totals: dict[str, Tensor] = {}  # 1-D float64 of 3 by unit, on the device
        self.holders = 0  # the callbacks sampling this step
        self._exact: dict[int, Tensor] = {}  # id(flat parameter) -> its exact shard, until the packed one lands

    @staticmethod
    def join(units: Sequence[Any]) -> ReduceSample:
        """The sample the units hold this step (another callback's), or a new one set on each of them."""
        sample = next((u.reduce_sample for u in units if u.reduce_sample is not None), None) or ReduceSample()
        for unit in units:
            unit.reduce_sample = sample
        sample.holders += 1
        return sample

    def leave(self, units: Sequence[Any]) -> None:
        """A holder is done (it has read the sums): the units reduce exactly no more once every holder is."""
        self.holders -= 1
        if self.holders <= 0:
            for unit in units:
                if unit.reduce_sample is self:
                    unit.reduce_sample = None

    @property
    def sums(self) -> dict[str, list[float]]:
        """The totals on the host, by unit (one read per unit)."""
        return as_lists(self.totals, "reduction error")

    def reduce_exactly(self, fp: FlatParam, flat: Tensor, group: Comm) -> None:
        """Every rank of ``group``, before the packed call: the exact mean of ``flat`` in fp32, this rank's shard."""
        exact = torch.empty(fp.layout.shard_numel, dtype=torch.float32, device=flat.device)
        collectives.reduce_scatter(exact, flat.float(), group, label=EXACT_LABEL)
        self._exact[id(fp)] = exact

    def compare(self, unit: str, fp: FlatParam, reduced: Tensor) -> None:
        """The packed call's shard has landed: add its difference from the exact shard to ``unit``'s sums."""
        exact = self._exact.pop(id(fp), None)
        if exact is not None:
            add_sums(self.totals, unit, error_sums(reduced.float() - exact, exact))
