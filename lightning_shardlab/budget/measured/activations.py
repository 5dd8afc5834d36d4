"""Activations on the ledger: the bytes autograd saves for backward in a step, by unit, measured.

Between a forward and its backward the largest part of a step's memory is often neither parameters nor
optimizer state but what autograd keeps to compute gradients: each op's saved inputs and outputs. During
every forward of a training step, each tensor that autograd saves passes through a ``saved_tensors_hooks``
pack hook (kept as it is: the hook only counts). It is counted by its *storage*, once (a view and the tensor
it views, or one tensor saved by two ops, hold one storage: its bytes count once), and charged to the
innermost unit whose forward is running when it is saved (forward hooks on each unit's modules; outside all
of them, the root unit). Parameters and the units' full buffers are model state, counted in the budget's
other columns, so their storages are left out.

A unit under activation checkpointing saves nothing inside its forward (torch's checkpoint holds the unit's
inputs and recomputes in backward); its inputs are what it keeps, so they are charged to it.

The figure is "at the peak": with several forwards per step (gradient accumulation) the largest one, which is
what is alive when backward starts. ``ActivationMeter`` is driven by ``ShardLabBudget`` around each training
step; the plan predicts the same figure without running (budget/predicted/forward_trace.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from lightning_shardlab.sharding.sharded_model import ShardedModel

ROOT = "root"


def storage_key(tensor: Tensor) -> int:
    """The identity of the storage under ``tensor`` (the same for every view of it)."""
    return tensor.untyped_storage()._cdata


class SavedBytes:
    """Storages saved for backward in one forward, each counted once, by the unit that saved it first."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.seen: set[int] = set()
        self.by_unit: dict[str, int] = {}

    def add(self, unit: str, tensor: Tensor) -> None:
        key = storage_key(tensor)
        if key in self.seen or key in self.excluded:
            return
        self.seen.add(key)
        self.by_unit[unit] = self.by_unit.get(unit, 0) + tensor.untyped_storage().nbytes()

    @property
    def total(self) -> int:
        return sum(self.by_unit.values())


class UnitStack:
    """Which unit's forward is running: forward pre/post hooks on each unit's modules push and pop its name.
    As a checkpointed module's forward begins, ``on_enter(unit, inputs)`` is called (hooked after the units'
    hooks, so a checkpointed unit is the current one)."""

    def __init__(self, units: dict[str, list[nn.Module]], checkpointed: list[nn.Module], on_enter: Callable) -> None:
        self.running: list[str] = []
        self.handles: list[RemovableHandle] = []
        for name, modules in units.items():
            for module in modules:
                self.handles.append(module.register_forward_pre_hook(self._enter(name)))
                self.handles.append(module.register_forward_hook(self._leave))
        for module in checkpointed:  # torch's checkpoint keeps every tensor argument, keywords and nested ones too
            hook = module.register_forward_pre_hook(
                lambda m, args, kwargs: on_enter(self.current, tree_leaves((args, kwargs))), with_kwargs=True
            )
            self.handles.append(hook)

    def _enter(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.running.append(name)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.running:
            self.running.pop()

    @property
    def current(self) -> str:
        return self.running[-1] if self.running else ROOT

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def model_state_storages(sharded: ShardedModel) -> set[int]:
    """Storages of the flat parameters' buffers and of the module's parameters: model state, not activations."""
    keys = set()
    for fp in sharded.flat_params:
        for tensor in (fp.full, fp.shard, fp.master):
            if isinstance(tensor, Tensor):
                keys.add(storage_key(tensor))
    keys.update(storage_key(p) for p in sharded.module.parameters())
    return keys


class ActivationMeter:
    """Measures each training forward's saved-for-backward bytes by unit; keeps the largest (the peak)."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded
        units = {u.name: list(u.modules) for u in sharded.units if not u.is_root}
        self.stack = UnitStack(units, checkpointed_modules(sharded), self._inputs_kept)
        self.forward: SavedBytes | None = None
        self.peak: dict[str, int] = {}
        self._hooks: Any = None

    def start(self) -> None:
        """A training step begins: count what its forwards save."""
        self.forward = SavedBytes(model_state_storages(self.sharded))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def stop(self) -> None:
        """The step ended: keep its figures if they are the largest so far."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        if self.forward is not None and self.forward.total >= sum(self.peak.values()):
            self.peak = dict(self.forward.by_unit)
        self.forward = None

    def remove(self) -> None:
        self.stop()
        self.stack.remove()

    def _pack(self, tensor: Tensor) -> Tensor:
        """Count ``tensor``; autograd keeps a detached alias of it (the same storage and version counter): the
        tensor itself would hold its own graph in a cycle that a forward never followed by backward would leak
        (torch's note on pack hooks), and backward, double backward included, computes the same from the alias."""
        if self.forward is not None:
            self.forward.add(self.stack.current, tensor)
        return tensor.detach()

    def _inputs_kept(self, unit: str, args: list[Any]) -> None:
        """A checkpointed module's forward begins: its tensor inputs are what it keeps for backward."""
        if self.forward is not None and torch.is_grad_enabled():
            for arg in args:
                if isinstance(arg, Tensor):
                    self.forward.add(unit, arg)

    def report(self) -> dict[str, Any]:
        """The peak forward's bytes by unit (units in the model's order) and in total."""
        order = [u.name for u in self.sharded.units]
        by_unit = {name: self.peak.get(name, 0) for name in order if name in self.peak or name == ROOT}
        return {"by_unit": by_unit, "total": sum(by_unit.values()), "checkpointed": checkpointed_names(self.sharded)}


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def checkpointed_names(sharded: ShardedModel) -> list[str]:
    """The names of the modules that run under activation checkpointing (the ``activation_checkpointing``
    option records them on the sharded model)."""
    return list(sharded.checkpointed)


def checkpointed_modules(sharded: ShardedModel) -> list[nn.Module]:
    modules = dict(sharded.module.named_modules())
    return [modules[name] for name in checkpointed_names(sharded) if name in modules]
