"""The error each fewer-bytes option brings, as vital signs: relative L2 per unit on every logged step.

``gather_dtype='int8'`` and ``reduce_dtype`` 'bf16' / 'fp16' / 'int8' (docs/slow_links.md) trade exactness for bytes.
The budget prints their error once, as fit ends (budget/measured/option_error.py); a curve shows whether it grows as
training goes on (weights that drift into larger blocks, gradients that shrink under their block's scale). On each
step ``ShardLabVitals`` logs, only where an option is on:

    option_error/gather/<unit>  the weights every rank computes with (int8 blocks, unpacked) against the fp32
                                masters, as the step ends (after the optimizer step: what the next forward gathers)
    option_error/reduce/<unit>  the unit's reduced gradient against an exact fp32 reduction of the same gradients
                                (sharding/reduce_sample.py: one extra reduce-scatter per flat parameter, on logged
                                steps only; a step the budget samples too is reduced exactly once, for both, and
                                the figure then covers the step's micro-batches so far)

Both are global signs: the weights every rank computes with are the same on every rank, and a reduction's result
belongs to every rank of its group. Each rank sums its own shards' squared error, squared reference and largest
difference (sharding/packing_error.py, where the budget takes its sums from too), on the device; the sums ride in
the vitals' own all-gather of the step (no collective of their own), and rank 0 combines them over every rank as the
budget does (``combine``). With the defaults there are no such signals, no sample and no extra call.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_shardlab.sharding.packing_error import combine, gather_error_sums
from lightning_shardlab.sharding.reduce_sample import ReduceSample

PREFIX = "option_error"
SUMS = 3  # squared error, squared reference, max |error|: per signal and rank


class OptionCurves:
    """Which units an option packs, this step's sample of the packed reductions, and the curves' values."""

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded
        units = sharded.units if sharded is not None else []
        self.gather = [u.name for u in units if any(_packs_gather(fp) for fp in u.flat_params)]
        self.reduce = [
            u.name
            for u in units
            if u.shard_group.world_size > 1 and any(fp.reduce_packing is not None for fp in u.flat_params)
        ]
        self.frozen = {u.name for u in units if not any(fp.layout.requires_grad for fp in u.flat_params)}
        self.sample: ReduceSample | None = None

    @property
    def signals(self) -> list[str]:
        return [f"{PREFIX}/gather/{u}" for u in self.gather] + [f"{PREFIX}/reduce/{u}" for u in self.reduce]

    def start(self) -> None:
        """A logged step begins: its packed reductions are set against exact ones (another callback's sample of the
        same step is joined, not doubled)."""
        if self.reduce and self.sample is None:
            self.sample = ReduceSample.join(self.sharded.units)

    def end(self) -> None:
        """The step's sums are in the row: reduce exactly no more (unless another callback still samples)."""
        if self.sample is not None:
            self.sample.leave(self.sharded.units)
            self.sample = None

    def sums(self, device: torch.device) -> Tensor:
        """This rank's part of the row: ``SUMS`` floats per signal, NaN where it had none (a unit that did not
        reduce in this step). 1-D float64 on ``device``, nothing read by the host."""
        gathered = gather_error_sums(self.sharded) if self.gather else {}
        reduced = self.sample.totals if self.sample is not None else {}
        parts = [gathered.get(u) for u in self.gather] + [reduced.get(u) for u in self.reduce]
        nan = torch.full((SUMS,), math.nan, dtype=torch.float64, device=device)
        row = [nan if p is None else p.to(device) for p in parts]
        return torch.cat(row) if row else nan[:0]

    def values(self, sums: np.ndarray) -> list[float]:
        """Rank 0: each signal's relative L2 over every rank's sums (``sums``: world x ``SUMS`` per signal)."""
        out = []
        for k in range(len(self.signals)):
            block = sums[:, SUMS * k : SUMS * (k + 1)]
            per_rank = [{"u": row.tolist()} for row in block if not np.isnan(row).any()]
            out.append(combine(per_rank)["u"]["rel_l2"] if per_rank else math.nan)
        return out

    def reason(self, signal: str) -> str:
        """Why an option's curve has no value at any logged step."""
        _, option, unit = signal.split("/", 2)
        if option == "reduce" and unit in self.frozen:
            return "frozen: no gradient, nothing reduced"
        if option == "reduce":
            return "no packed reduction ran in a logged step (accumulation='defer': only a step's last micro-batch)"
        return "no logged step"


def _packs_gather(fp: Any) -> bool:
    """The flat parameter's weights travel packed between ranks (gather_error_sums measures exactly these)."""
    return fp.gather_packing is not None and fp.layout.world_size > 1
