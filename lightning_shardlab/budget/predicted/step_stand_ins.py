"""What a user's ``training_step`` reads besides its batch, stood in for while the budget traces it under fake tensors.

A real step logs, reads its trainer, updates metrics and turns tensors into Python numbers; none of that changes what
autograd saves or computes, but each would stop a trace (shapes only). So, inside ``standing_in``: **the trainer** is
a ``TrainerView`` (reads go to the real trainer, writes stay on the view); **logging** does nothing (a fake value
would reach the real logger); **torchmetrics metrics** update nothing and give a fake 0 (their states are real
tensors a fake update cannot write); **a data-dependent scalar** (``.item()``, ``float(t)``, ``bool(t)``) reads 0, so
a branch on a value takes the path of 0. Still untraceable: a step that optimizes by hand (its optimizer steps act on
the real run), an op whose output's shape depends on values (``nonzero``, boolean indexing), code that reads a
tensor's memory (``.numpy()``). There the budget falls back to ``forward`` and a loss, and says why when that fails
too (``in_words``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


class TrainerView:
    """The trainer as a traced ``training_step`` sees it: attributes read through to ``trainer``; set on the view
    alone. It holds the trainer weakly: the budget's copy of the module (and whatever keeps it) never keeps a
    finished run's trainer, and its sharded model, alive."""

    def __init__(self, trainer: Any) -> None:
        object.__setattr__(self, "_read_from", weakref.ref(trainer))

    def __getattr__(self, name: str) -> Any:  # only for names the view does not hold itself
        trainer = object.__getattribute__(self, "_read_from")()
        if trainer is None:
            raise AttributeError(f"the trainer is gone (its fit ended): no {name!r} to read")
        return getattr(trainer, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> TrainerView:
        return self  # a copy of a copy reads the same trainer


class ConcreteScalars(TorchDispatchMode):
    """Under a fake mode: a tensor turned into a Python number reads 0 of its kind (``False``, ``0``, ``0.0``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is LOCAL_SCALAR:
            dtype = args[0].dtype
            return False if dtype is torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0
        return func(*args, **(kwargs or {}))


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _fake_zero(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros(())  # made under the trace's fake mode: a fake scalar


def refuse_manual_optimization(model: nn.Module) -> None:
    """``ValueError`` for a step that optimizes by hand: its optimizer steps would act on the real run."""
    if getattr(model, "automatic_optimization", True) is False:
        raise ValueError(
            "training_step optimizes by hand (automatic_optimization=False): its optimizer steps and"
            " manual_backward act on the real run, so it is not traced; forward and a loss stand in for it"
        )


def _stand_ins(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """(object, attribute, stand-in) for every logging method and metric of ``model``."""
    from lightning.pytorch import LightningModule
    from torchmetrics import Metric

    out = []
    for module in model.modules():
        if isinstance(module, LightningModule):
            out += [(module, "log", _nothing), (module, "log_dict", _nothing)]
        if isinstance(module, Metric):
            out += [(module, "forward", _fake_zero), (module, "update", _nothing), (module, "compute", _fake_zero)]
    return out


@contextmanager
def standing_in(model: nn.Module) -> Iterator[None]:
    """Inside (and inside a fake mode): ``model``'s logging and metrics stood in for, data-dependent scalars read 0.
    ``ValueError`` for a step that optimizes by hand. Everything is put back on leaving."""
    refuse_manual_optimization(model)
    missing = object()
    saved = []
    for owner, name, stand_in in _stand_ins(model):
        saved.append((owner, name, owner.__dict__.get(name, missing)))
        owner.__dict__[name] = stand_in
    try:
        with ConcreteScalars():
            yield
    finally:
        for owner, name, before in reversed(saved):
            if before is missing:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = before


def in_words(err: BaseException) -> str:
    """Why a step did not trace, in a few words for the budget's tables (the JSON keeps the whole error)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    text = str(err)
    if isinstance(err, DynamicOutputShapeException):
        return f"an op's output shape depends on values ({err.func}: nonzero, masked_select, boolean indexing)"
    if isinstance(err, DataDependentOutputException):
        return f"it reads values a trace does not have ({err.func})"
    if "automatic_optimization=False" in text:
        return "training_step optimizes by hand (automatic_optimization=False)"
    if "data pointer" in text or "numpy" in text.lower():
        return "it reads a tensor's memory (.numpy(), .tolist(), data_ptr)"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first[:100]}"
