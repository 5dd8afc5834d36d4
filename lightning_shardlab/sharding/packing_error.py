"""What packing loses, per unit: a fewer-bytes option's values set against the exact ones, as sums over shards.

``gather_dtype='int8'`` and ``reduce_dtype`` 'bf16' / 'fp16' / 'int8' (docs/slow_links.md) send each rank's values in
fewer bytes. Their error is measured on the run's own tensors, by two callbacks that cannot import each other: the
budget's end-of-fit table (budget/measured/option_error.py) and the vitals' curves (vitals/option_curves.py). Both
take their sums from here, so both show the same numbers:

- ``gather_error_sums``: the weights every rank computes with (this rank's compute shard packed, then unpacked)
  against the fp32 masters, on the real elements of this rank's shard;
- a packed reduction against an exact one (sharding/reduce_sample.py adds its sums with ``add_sums``).

Each rank keeps, by unit, ``[squared error, squared reference, max |error|]`` of its own shards, summed where the
values live (on a GPU, on the device: nothing is read by the host per flat parameter). ``combine`` sets every rank's
sums together: relative L2 is ``sqrt(sum of squared error / sum of squared reference)`` over the unit's elements on
all ranks, the largest difference the largest of any rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_shardlab.comm.host_reads import to_device, to_host


def error_sums(error: Tensor, reference: Tensor) -> Tensor:
    """``[squared error, squared reference, max |error|]`` of two 1-D tensors of one shard: float64, where they are."""
    largest = error.abs().max().double() if error.numel() else error.new_zeros((), dtype=torch.float64)
    return torch.stack([error.double().square().sum(), reference.double().square().sum(), largest])


def add_sums(sums: dict[str, Tensor], unit: str, new: Tensor) -> None:
    """Add one shard's ``error_sums`` into ``unit``'s: the squares summed, the largest difference kept."""
    before = sums.get(unit)
    sums[unit] = new if before is None else torch.cat([before[:2] + new[:2], torch.maximum(before[2:], new[2:])])


def gather_error_sums(sharded: Any) -> dict[str, Tensor]:
    """By unit: this rank's real shard elements as every rank computes with them (packed, then unpacked) against
    its masters. Empty unless ``gather_dtype`` packs some flat parameter across ranks."""
    sums: dict[str, Tensor] = {}
    for unit in sharded.forward_order:
        for fp in unit.flat_params:
            if fp.gather_packing is None or fp.layout.world_size == 1:
                continue
            real = fp.layout.shard_numel - fp.layout.padding_in_shard(fp.rank)
            shard = fp.shard.detach()
            gathered = fp.gather_packing.unpack(fp.gather_packing.pack(shard), shard.new_empty(shard.shape))
            master = to_device(fp.master.detach()[:real], shard.device).float()  # an offloaded master: brought up
            add_sums(sums, unit.name, error_sums(gathered[:real].float() - master, master))
    return sums


def as_lists(sums: dict[str, Tensor], why: str) -> dict[str, list[float]]:
    """The sums on the host, as plain numbers (for a report that travels as an object): one read per unit."""
    return {unit: to_host(t, why).tolist() for unit, t in sums.items()}


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
