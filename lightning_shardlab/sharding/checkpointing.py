"""Activation checkpointing: the modules ``activation_checkpointing`` chooses recompute their forward in backward.

Each chosen module keeps its class, its parameters and their names: only the instance's ``forward`` is replaced,
in place, by ``functools.partial(checkpointed_forward, <its forward>)``, which runs the original under torch's
non-reentrant ``torch.utils.checkpoint.checkpoint`` whenever gradients are enabled (``undo`` puts it back). The
module's hooks run outside it, as ``nn.Module.__call__`` runs them around ``forward``: a unit's forward pre-hook
(gather, the post-backward hook on its inputs) and forward hook (free, the pre-backward hook on its outputs) run
once, in forward, and never during the recomputation.

How it composes with sharding, at every stage: autograd recomputes a module's forward when its backward first
reads a tensor saved inside it, which is after the first gradient reached the module's outputs. For a unit, that
gradient announced its pre-backward first (sharding/hooks.py): the unit is gathered for backward, as it would be
without checkpointing, and stays gathered until its post-backward. The recomputation reads that gather, so no
extra all-gather is made: at stage 3 the unit is gathered once in forward and once in backward, with or without
checkpointing (with ``reshard_after_forward=False`` once). A chosen module inside a unit recomputes while its
unit's backward runs (gathered); inside the root, while the root is held for the step.

Which modules:

- ``True``: the modules of every unit but the root (each block of a bucket);
- classes: every module of those classes; a callable: every module it accepts;
- a chosen module inside another chosen one is left to the outer one (recomputing it once is enough);
- a module that already runs under a Hugging Face model's own checkpointing (``gradient_checkpointing_enable()``
  sets ``gradient_checkpointing = True`` on each layer, or on the layers' parent in older versions) is left to
  it: a warning names such modules;
- a module that holds units is refused: its recomputation would run those units' forwards inside backward.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn


def checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``, its activations recomputed in backward when gradients are enabled."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # no backward will come: nothing to save, nothing to recompute
    return torch.utils.checkpoint.checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)


def chosen_modules(
    module: nn.Module,
    option: bool | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool],
    units: dict[str, str],
    warn: bool = True,
) -> list[str]:
    """The names (as ``module.named_modules()`` gives them) of the modules ``option`` chooses; ``units``: the name
    of each module of a non-root unit -> that unit's name. Raises ``ValueError`` for a module that holds units;
    with ``warn`` (rank 0) names the modules a Hugging Face model checkpoints already, and says when none is
    chosen."""
    if option is False:
        return []
    named = dict(module.named_modules())
    if option is True:
        names = [name for name in named if name in units]
    elif isinstance(option, tuple):
        names = [name for name, m in named.items() if isinstance(m, option)]
    else:
        names = [name for name, m in named.items() if option(m)]
    names = [n for n in names if not any(_inside(n, outer) for outer in names if outer != n)]
    for name in names:
        held = sorted({unit for member, unit in units.items() if _inside(member, name) and member != name})
        if held:
            raise ValueError(
                f"`activation_checkpointing` chose {name or 'the root module'!r} ({type(named[name]).__name__}),"
                f" which holds the units {', '.join(map(repr, held))}: recomputing it in backward would run their"
                " forwards (and their gathers) again inside backward. HINT: checkpoint the units or modules inside"
                " them (activation_checkpointing=True, or their classes)."
            )
    by_model = [n for n in names if _checkpointed_by_model(named, n)]
    if by_model and warn:
        warnings.warn(
            f"`activation_checkpointing`: {', '.join(map(repr, by_model))} already run under the model's own"
            " activation checkpointing (Hugging Face's gradient_checkpointing_enable()); left to it, not wrapped"
            " a second time.",
            stacklevel=3,
        )
    names = [n for n in names if n not in by_model]
    if not names and not by_model and warn:
        warnings.warn(
            f"`activation_checkpointing={option!r}` chose no module of {type(module).__name__}"
            + (" (it has no unit but the root: see unit_bucket_params)." if option is True else "."),
            stacklevel=3,
        )
    return names


def apply(module: nn.Module, names: list[str]) -> list[str]:
    """Run the forward of each named submodule of ``module`` under checkpoint, in place; returns ``names``."""
    for name in names:
        sub = module.get_submodule(name)
        if not _is_checkpointed(sub):
            forward = functools.partial(checkpointed_forward, sub.forward)
            forward.__wrapped__ = sub.forward  # type: ignore[attr-defined]  # inspect.signature reads the original
            sub.forward = forward  # type: ignore[method-assign]
    return names


def undo(module: nn.Module, names: list[str]) -> None:
    """Give each named submodule its own forward back (what ``apply`` replaced)."""
    for name in names:
        sub = module.get_submodule(name)
        if _is_checkpointed(sub):
            original = sub.__dict__.pop("forward").args[0]
            if not (getattr(original, "__self__", None) is sub and original.__func__ is type(sub).forward):
                sub.forward = original  # the instance had a forward of its own  # type: ignore[method-assign]


def _is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is checkpointed_forward


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or lies inside it ("" is the root)."""
    return outer == "" or name == outer or name.startswith(outer + ".")


def _checkpointed_by_model(named: dict[str, nn.Module], name: str) -> bool:
    """Whether ``name`` runs under a Hugging Face model's checkpointing: it, or a module it lies inside other than
    the root, has ``gradient_checkpointing`` set to True."""
    return any(
        getattr(m, "gradient_checkpointing", False) is True and _inside(name, outer)
        for outer, m in named.items()
        if outer
    )
