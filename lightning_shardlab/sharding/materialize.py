"""Models larger than a rank: parameters created on the meta device, materialised a module at a time.

A module built under ``configure_model`` (or ``trainer.init_module(empty_init=True)``) with the shardlab
strategy has only shapes. ``materialize`` walks the modules in registration order — the order their
constructors would have run — and for each one: allocates its own parameters and buffers
(``to_empty(recurse=False)``), runs its ``reset_parameters()`` (drawing from the random generator just
as an eager init would), copies the values into the flat parameters they belong to, and frees them.
A flat parameter is handed over (broadcast from rank 0, sliced to this rank's shard) as soon as all
its values exist, so a rank never holds more than the unit being built and the root unit.

Values equal an eager init from the same seed when every module initialises its own parameters in
``reset_parameters`` (as torch's layers do). A tied parameter keeps the value of its first module,
as it would eagerly; later modules still draw their random numbers, so the sequence stays aligned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.policy import ParamUse


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _reset(module: nn.Module, name: str) -> None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"module {name or 'root'!r} ({type(module).__name__}) has parameters or buffers on the meta device but no"
            " reset_parameters() to initialise them. HINT: give it a reset_parameters() that fills its own"
            " parameters and buffers, or build the model without empty_init / outside configure_model."
        )
    reset()


def materialize(
    root: nn.Module,
    groups: list[tuple[FlatParam, list[ParamUse]]],
    device: torch.device,
    load: Callable[[FlatParam, list[Tensor]], None],
) -> None:
    """Initialise every meta parameter and buffer; ``load(fp, values)`` each flat parameter once complete."""
    where = {id(use.param): (fp, i) for fp, group in groups for i, use in enumerate(group)}
    pending: dict[FlatParam, list[Tensor | None]] = {}
    for fp, group in groups:
        if any(u.param.is_meta for u in group):
            pending[fp] = [None if u.param.is_meta else u.param for u in group]
        else:
            load(fp, [u.param for u in group])  # nothing to build
    for name, module in root.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(t.is_meta for t in (*own.values(), *module.buffers(recurse=False))):
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            _reset(module, name)
        for attr, original in own.items():
            fp, i = where[id(original)]
            slots = pending.get(fp)
            if slots is not None and slots[i] is None:  # a tied parameter keeps its first module's value
                slots[i] = module._parameters[attr].detach()
                if all(v is not None for v in slots):
                    load(fp, pending.pop(fp))
            module._parameters[attr] = original  # the real tensor goes; shard_model points the name elsewhere
    assert not pending, f"flat parameters left unbuilt: {[fp.layout.name for fp in pending]}"
