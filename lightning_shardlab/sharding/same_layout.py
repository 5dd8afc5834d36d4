"""Before any tensor moves at setup: every rank built the same model, and what the default policy declined.

``check_same_layout`` compares every rank's parameters (name, shape, dtype, requires_grad, owning unit) and
buffers in one all-gather of small objects and raises on every rank, naming the first difference, so a model
built differently on one rank is refused before the first parameter collective (which would otherwise hang
or move the wrong bytes). ``warn_declined`` names the containers of repeated blocks left whole.
"""

from __future__ import annotations

import warnings

from torch import nn

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.sharding.policy import ParamUse


def warn_declined(module: nn.Module, declined: list[str]) -> None:
    kinds = sorted({type(next(module.get_submodule(path).children())).__name__ for path in declined})
    warnings.warn(
        f"the repeated blocks in {', '.join(map(repr, declined))} ({', '.join(kinds)}) are not made units: nothing"
        " shows that every forward runs all of them (experts of a mixture-of-experts layer, a block chosen by the"
        " step), so they stay in the enclosing unit, gathered whole on every rank. HINT: if every rank always runs"
        " every one of them, name their class in unit_classes=[...] to shard them one by one.",
        stacklevel=3,
    )


def check_same_layout(module: nn.Module, uses: list[ParamUse], owners: dict[int, str], comm: Comm) -> None:
    """Raise on every rank, naming the first difference, unless all ranks built the same layout."""
    mine = [
        (
            "parameter",
            u.fqns[0],
            tuple(u.param.shape),
            str(u.param.dtype),
            u.param.requires_grad,
            f"unit {owners[id(u.param)] or 'root'}",
        )
        for u in uses
    ]
    mine += [("buffer", name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()]
    everyone = collectives.all_gather_object(mine, comm, label="layout check")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else "nothing"
            b = theirs[i] if i < len(theirs) else "nothing"
            if a != b:
                raise ValueError(
                    f"[rank {comm.rank}] the model differs across ranks: entry {i} is {a} on rank 0 but {b} on rank"
                    f" {rank}. HINT: build the same model (same classes, shapes, dtypes, requires_grad) on every rank."
                )
