"""``gathered_params``: the full weights between steps, to read or to change (DeepSpeed's
``GatheredParameters``, FSDP's ``summon_full_params``).

    with trainer.strategy.gathered_params():                        # every unit
        total = sum(float(p.sum()) for p in model.parameters())     # full values, on every rank
    with trainer.strategy.gathered_params([model.head], writeback=True):
        model.head.weight.mul_(0.5)                                 # lands in every rank's shard

Collective: every rank enters with the same ``modules``. For each unit that owns a parameter of one of
``modules`` (every unit if None), in unit order, each flat parameter's master shards are all-gathered,
one flat parameter at a time, into a full buffer in master precision (under mixed precision: the fp32
values the optimizer holds, not the bf16 compute copies), and the module's parameters (the same objects
as always) hold views of it as their data. Memory: the full buffers of the selected units, held until the block
ends (every unit: the whole model, as with FSDP; name modules to hold less).

On exit with ``writeback=True`` each rank takes its own slice of the full values, changed or not, into
its master shard (a change made the same way on every rank therefore lands everywhere; one made on one
rank only lands in that rank's slice, as in FSDP), and compute copies are refreshed. Without it, changes
are discarded (at stages 1-2 in fp32, where the resident full buffer already holds the master values,
the block gets a copy); a parameter whose ``.data`` the block replaced counts as changed. Then the
parameters hold their stubs (stage 3) or their views of the full buffers again.
Inside, a gathered unit's forward must run without gradients: its full copies are not trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from lightning_shardlab.sharding.flat_param import FlatParam, alias
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.sharding.unit import Unit, UnitState

Modules = Iterable[nn.Module | str] | nn.Module | str | None


@contextmanager
def gathered_params(sharded: ShardedModel, modules: Modules = None, writeback: bool = False) -> Iterator[None]:
    """Collective: the selected units' full master-precision parameters in the module (see the module docstring)."""
    units = selected_units(sharded, modules)
    sharded.wait_gathers()
    summoned: list[tuple[Unit, UnitState, list[Tensor]]] = []
    ok = False
    try:
        for unit in units:
            fulls = [_full_values(sharded, fp, writeback) for fp in unit.flat_params]
            copies = [fp.views if full is fp.full else _views(fp, full) for fp, full in zip(unit.flat_params, fulls)]
            summoned.append((unit, unit.summon(copies), fulls))
        yield
        ok = True
    finally:
        for unit, previous, _ in summoned:
            unit.unsummon(previous)
        if writeback and ok:
            _write_back(sharded, summoned)


def selected_units(sharded: ShardedModel, modules: Modules) -> list[Unit]:
    """The units owning a parameter of ``modules`` (objects or names in the sharded module), in unit order."""
    if modules is None:
        return list(sharded.units)
    if isinstance(modules, (nn.Module, str)):
        modules = [modules]
    owner = {id(p): unit for unit in sharded.units for fp in unit.flat_params for p in fp.params}
    wanted: set[int] = set()
    for m in modules:
        module = sharded.module.get_submodule(m) if isinstance(m, str) else m
        found = [owner[id(p)] for p in module.parameters() if id(p) in owner]
        if not found and any(True for _ in module.parameters()):
            raise ValueError(
                f"gathered_params(): {type(module).__name__} is not part of the sharded"
                f" {type(sharded.module).__name__}. HINT: pass its submodules, or their names."
            )
        wanted.update(id(u) for u in found)
    return [u for u in sharded.units if id(u) in wanted]


def _full_values(sharded: ShardedModel, fp: FlatParam, writeback: bool) -> Tensor:
    """The flat parameter's full values in master precision (1-D, padded_numel). Collective unless resident."""
    full = sharded.gather_full(fp)
    if full is fp.full and not writeback:
        return full.clone()  # the live buffer itself: a copy, so that changes are discarded
    return full


def _views(fp: FlatParam, full: Tensor) -> list[Tensor]:
    return [alias(full, slot.offset, slot.shape) for slot in fp.layout.slots]


def _write_back(sharded: ShardedModel, summoned: list[tuple[Unit, UnitState, list[Tensor]]]) -> None:
    changed = set()
    with torch.no_grad():
        for unit, _, fulls in summoned:
            for fp, full in zip(unit.flat_params, fulls):
                start, end = fp.layout.shard_range(fp.rank)
                if full is not fp.full:  # the resident fp32 buffer holds the master as a view already
                    fp.master.copy_(full[start:end])
                changed.add(fp)
    sharded.refresh(changed)  # compute shards, and full buffers that are resident or gathered
