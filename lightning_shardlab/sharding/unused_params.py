"""Which parameters got a gradient in this step, on any rank: DDP's ``find_unused_parameters``, by default.

Each unit notes, in its post-backward, which of its parameters got a gradient on this rank (``Unit.used``,
one bool per parameter, accumulated over the micro-batches of a step). At the end of backward the ranks
agree: one all-reduce (max) of those bits, launched before the last reductions are waited for, so it
travels while they do. The bits are host facts and stay host tensors: on NCCL they travel on the group's gloo
twin (comm/host_side.py), so the device's queue is neither waited for nor touched. A parameter that no rank
used keeps a ``None`` gradient (the optimizer skips it: no weight decay, no momentum), one that some rank used
gets the averaged gradient (zeros from the ranks that did not use it), exactly as on one device and under DDP.
``find_unused_parameters=False`` skips the all-reduce: every parameter of a unit that ran backward then counts as
used (a zero gradient), and a warning names those that got none. Nothing here is unit-specific beyond the bits
it is handed.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm, Pending
from lightning_shardlab.sharding.unit import Unit


class UsageAgreement:
    """The agreement for one step's units; ``launch`` it, then read ``result()`` (every rank, same units)."""

    def __init__(self, units: Sequence[Unit], bits: Tensor | None, pending: Pending | None) -> None:
        self.units, self.bits, self.pending = list(units), bits, pending

    @staticmethod
    def launch(units: Sequence[Unit], comm: Comm, exact: bool, warned: set[str]) -> UsageAgreement:
        local = [used for unit in units for used in unit.used]
        if not local or not exact:
            if local:
                _warn_unused(units, comm.rank, warned)
            return UsageAgreement(units, None, None)
        bits = torch.cat(local).to(torch.int32)  # 1-D, one per parameter of these units: a host tensor
        return UsageAgreement(
            units, bits, collectives.launch_all_reduce(bits, comm.host_side, op="max", label="unused parameters")
        )

    def result(self) -> list[list[Tensor]]:
        """Per unit, per flat parameter: 1-D bool, one per parameter: counts as having a gradient."""
        local = [used for unit in self.units for used in unit.used]
        if self.pending is None:
            agreed = [torch.ones_like(u) for u in local]
        else:
            self.pending.wait()
            agreed = list(self.bits.bool().split([u.numel() for u in local]))
        out, i = [], 0
        for unit in self.units:
            out.append(agreed[i : i + len(unit.used)])
            i += len(unit.used)
        return out


def _warn_unused(units: Sequence[Unit], rank: int, warned: set[str]) -> None:
    names = [
        slot.name
        for unit in units
        for fp, used in zip(unit.flat_params, unit.used)
        for slot, param, u in zip(fp.layout.slots, fp.params, used.tolist())
        if param.requires_grad and not u and slot.name not in warned
    ]
    if names:
        warned.update(names)
        warnings.warn(
            f"[rank {rank}] parameters got no gradient in a unit that ran backward and receive a zero gradient"
            f" (find_unused_parameters=False): {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}. HINT: leave"
            " find_unused_parameters at its default, True, to leave their gradients None as one device and DDP do"
            " (AdamW then neither decays nor moves them).",
            stacklevel=4,
        )
