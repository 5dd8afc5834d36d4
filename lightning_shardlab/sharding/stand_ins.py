"""Stand-ins: for one block, an optimizer's param groups hold other tensors in place of the module's parameters.

The optimizer's class updates whatever its param groups hold and keys its state by those tensors. The engine
runs that update on tensors of its own — this rank's master views (sharding/optimizer.py), or an owner's
whole parameters (sharding/whole_step.py) — so for the block each original parameter is replaced by its
stand-in, its state moved to the stand-in's key, and afterwards both go back to the original. Between blocks
the param groups and the state belong to the module's own parameters (one parameter, one identity).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor
from torch.optim import Optimizer


@contextmanager
def standing_in(optimizer: Optimizer, stand_ins: dict[int, Tensor], keep_others: bool = True) -> Iterator[None]:
    """For the block: each parameter ``p`` of ``optimizer`` with a stand-in ``stand_ins[id(p)]`` is replaced by it
    in the param groups, its state keyed by it; the others stay (``keep_others``) or are left out. Afterwards the
    groups hold the originals again (group dicts made anew inside, by ``load_state_dict``, are mapped back as they
    are) and the state goes back to their keys."""
    originals: dict[int, Tensor] = {}  # id(stand-in) -> the original parameter
    for group in optimizer.param_groups:
        held = []
        for p in group["params"]:
            stand_in = stand_ins.get(id(p))
            if stand_in is None:
                if keep_others:
                    held.append(p)
                continue
            originals[id(stand_in)] = p
            if p in optimizer.state:
                optimizer.state[stand_in] = optimizer.state.pop(p)
            held.append(stand_in)
        group["params"] = held
    try:
        yield
    finally:
        for group in optimizer.param_groups:
            group["params"] = [originals.get(id(t), t) for t in group["params"]]
        for p in originals.values():
            stand_in = stand_ins[id(p)]
            if stand_in in optimizer.state:
                optimizer.state[p] = optimizer.state.pop(stand_in)
