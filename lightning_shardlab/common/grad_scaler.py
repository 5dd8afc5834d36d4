"""fp16's loss scale: torch's own ``GradScaler``, over the master shards, agreeing on overflow across the ranks.

Under "16-mixed" Lightning keeps a ``torch.amp.GradScaler`` at ``trainer.precision_plugin.scaler``; callbacks
log ``scaler.get_scale()``, tune it, and find its ``state_dict()`` in checkpoints. ``ShardedGradScaler`` is that
class, with one method changed, as torch's FSDP changes it: ``_unscale_grads_`` divides the gradients the
optimizer will read (this rank's master shards, not the parameters in its param groups), then takes the
maximum of the found-inf flag over the ranks (one all-reduce, "loss scale overflow"). A gradient that
overflowed on one rank only is in one rank's shard only, so without it that rank would skip the step and the
others would take it; with it every rank skips, as under DDP, whose all-reduce spreads the inf to every rank.
Everything else (the scale, its growth and backoff, ``step`` skipping on inf, ``update``, ``state_dict``) is
torch's, or the user's: a scaler given to Lightning's ``MixedPrecision(..., scaler=...)`` is kept, the same
object, its class swapped for a subclass of its own class with this one in front (``adopt``), so a subclass's
overrides (of ``update``, ``step``, ``scale``) run and ``trainer.precision_plugin.scaler`` is the user's scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.host_reads import to_host

if TYPE_CHECKING:
    from lightning_shardlab.sharding.sharded_model import ShardedModel


class ShardedGradScaler(torch.amp.GradScaler):
    def __init__(self, device: str, main_params: Callable[[Optimizer], list[Tensor]], **settings: Any) -> None:
        super().__init__(device, **settings)
        self.main_params = main_params  # the master views whose gradients the optimizer steps
        self.sharded: ShardedModel | None = None  # set by the strategy once the model is sharded
        self._overflow: dict[int, bool] = {}  # id(optimizer) -> any rank overflowed, since the last update()

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        assert self.sharded is not None, "the strategy connects the scaler to the sharded model before training"
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in self.main_params(optimizer):
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            for (device, _), group in grads.items():
                flag = found.setdefault(device, found_inf.to(device))
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.to(device))
        # every rank reduces one flag, holding grads or not (a rank may own only padding of every unit)
        anywhere = sum((f.to(found_inf.device) for f in found.values()), torch.zeros_like(found_inf))
        anywhere = collectives.all_reduce(
            anywhere.to(self.sharded.comm.device), self.sharded.comm, op="max", label="loss scale overflow"
        )
        self._overflow[id(optimizer)] = bool(
            to_host(anywhere, "loss scale overflow").item()
        )  # torch's scaler reads it too
        for flag in found.values():
            flag.copy_(anywhere)
        return found or {found_inf.device: found_inf.copy_(anywhere)}

    @property
    def device_type(self) -> str:
        """The device its scale lives on (torch keeps it as ``_device``; a CUDA scaler on a CPU run is disabled)."""
        return str(getattr(self, "_device", "cuda"))

    @classmethod
    def adopt(cls, scaler: torch.amp.GradScaler, main_params: Callable[[Optimizer], list[Tensor]]) -> ShardedGradScaler:
        """``scaler`` itself, sharded: its class becomes a subclass of its own with this class in front (named like
        its own), so its settings, state, identity and overrides stay; only ``_unscale_grads_`` is ours."""
        if not isinstance(scaler, ShardedGradScaler):
            scaler.__class__ = _sharded_scaler_class(type(scaler))
            scaler.sharded = None
            scaler._overflow = {}
        scaler.main_params = main_params  # type: ignore[attr-defined]
        return scaler  # type: ignore[return-value]

    @classmethod
    def like(
        cls, scaler: torch.amp.GradScaler | None, device: str, main_params: Callable[[Optimizer], list[Tensor]]
    ) -> ShardedGradScaler:
        """A sharded scaler on ``device`` with ``scaler``'s settings and state (the one a user gave Lightning's
        ``MixedPrecision(..., scaler=...)``, or an earlier device's), or torch's defaults."""
        ours = cls(device, main_params, enabled=scaler is None or scaler.is_enabled())
        if scaler is not None and scaler.is_enabled():
            ours.load_state_dict(scaler.state_dict())  # the scale, its growth tracker and settings
        ours.sharded = getattr(scaler, "sharded", None)
        return ours

    def unscaled(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were unscaled since the last ``update()`` (clipping does it first)."""
        return id(optimizer) in self._overflow

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (spawn) as its own class with this one put in front again where it is loaded (the class
        ``adopt`` made is named like the user's, under which pickle finds the user's); its state follows."""
        cls = type(self)
        if cls is ShardedGradScaler or _CLASSES.get(cls.__bases__[-1]) is not cls:
            return super().__reduce_ex__(protocol)
        return _adopted_again, (cls.__bases__[-1],), self.__getstate__()

    def overflowed(self, optimizer: Optimizer) -> bool:
        """Whether any rank found inf or nan in ``optimizer``'s gradients (after ``unscale_``)."""
        return self._overflow.get(id(optimizer), False)  # a disabled scaler unscales nothing

    def update(self, new_scale: float | Tensor | None = None) -> None:
        super().update(new_scale)
        self._overflow.clear()


_CLASSES: dict[type, type[ShardedGradScaler]] = {torch.amp.GradScaler: ShardedGradScaler}


def _sharded_scaler_class(cls: type[torch.amp.GradScaler]) -> type[ShardedGradScaler]:
    """``ShardedGradScaler`` in front of a user's GradScaler subclass, under the subclass's own name."""
    if cls not in _CLASSES:
        names = {"__name__": cls.__name__, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
        _CLASSES[cls] = type(cls.__name__, (ShardedGradScaler, cls), {**names, "__doc__": cls.__doc__})
    return _CLASSES[cls]


def _adopted_again(cls: type[torch.amp.GradScaler]) -> ShardedGradScaler:
    """Unpickling: an empty instance of the sharded class of ``cls``; pickle then gives it its state."""
    return object.__new__(_sharded_scaler_class(cls))
