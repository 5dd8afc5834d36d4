"""The optimizers no sharding can make exact, and why: refused on every rank, before any collective.

Any other optimizer runs: a known elementwise one on this rank's shard, a known or unknown other one on whole
parameters on their owner ranks (sharding/whole_step.py), which is exact for any update that reads a parameter, its
gradient and its own state. What is left cannot be made exact that way:

    LBFGS                     its step re-runs the closure (forward and backward, every rank taking part) inside a
                              line search along one direction over all parameters of the model together
    SparseAdam                it needs sparse gradients, which cannot be reduce-scattered into flat shards
    ZeroRedundancyOptimizer   torch's ZeRO stage 1: it shards its own state over the ranks itself, on parameters
                              shardlab has sharded already (and at stage 3 it reads their values while it is made)

A subclass is refused as its base is. At stage 3 ``ZeroRedundancyOptimizer`` fails while it is being made (it reads
the parameters' types, which a parameter at rest refuses): sharding/placeholders.py gives this refusal there,
found by ``refused_under_construction``, in place of the read error.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from lightning_shardlab.core.config import class_path

REASONS: dict[type[Optimizer], str] = {
    torch.optim.LBFGS: "its step re-runs the closure (a forward and backward every rank must take part in) during a"
    " line search along one direction over all parameters of the model together",
    torch.optim.SparseAdam: "it needs sparse gradients, which cannot be reduce-scattered into flat shards",
    ZeroRedundancyOptimizer: "it shards its own optimizer state over the ranks (torch's ZeRO stage 1), and shardlab"
    " shards the state already (and at stages 2-3 the gradients and parameters too), so each would hold a part of"
    " the other's",
}


def refusal(cls: type, rank: int, wrapped: tuple[type, dict[str, Any]] | None = None) -> ValueError | None:
    """The error refusing optimizer class ``cls`` (or a subclass of a refused class) on ``rank``, else None.
    ``wrapped``: the optimizer class and options a ``ZeroRedundancyOptimizer`` was given, named in its fix."""
    base = next((b for b in REASONS if issubclass(cls, b)), None)
    if base is None:
        return None
    if base is ZeroRedundancyOptimizer:
        inner = "torch.optim.AdamW(self.parameters(), lr=...)"
        if wrapped is not None:
            options = "".join(f", {k}={v!r}" for k, v in wrapped[1].items())
            inner = f"{class_path(wrapped[0])}(self.parameters(){options})"
        hint = (
            f"return the optimizer it wraps, {inner}, in its place: shardlab's stage 1 shards its state as"
            " ZeroRedundancyOptimizer would, and stages 2-3 shard more"
        )
    else:
        hint = "use another optimizer (AdamW, SGD, Muon, Adafactor, or a class of your own)"
    return ValueError(f"[rank {rank}] {cls.__name__} cannot run sharded: {REASONS[base]}. HINT: {hint}.")


def wrapped_by(optimizer: Optimizer) -> tuple[type, dict[str, Any]] | None:
    """The class and options a made ``ZeroRedundancyOptimizer`` wraps, else None."""
    inner = getattr(optimizer, "optim", None)
    if isinstance(optimizer, ZeroRedundancyOptimizer) and isinstance(inner, Optimizer):
        return type(inner), dict(getattr(optimizer, "_optim_defaults", {}))
    return None


def refused_under_construction(rank: int) -> ValueError | None:
    """The refusal of a refused optimizer whose ``__init__`` is on the stack (it read a parameter at rest while it
    was being made, before shardlab could see its class), else None."""
    for info in inspect.stack(context=0)[2:]:
        owner = info.frame.f_locals.get("self")
        if info.function == "__init__" and isinstance(owner, Optimizer):
            given = info.frame.f_locals.get("optimizer_class")
            wrapped = (given, dict(info.frame.f_locals.get("defaults") or {})) if isinstance(given, type) else None
            error = refusal(type(owner), rank, wrapped)
            if error is not None:
                return error
    return None
