"""Precision for sharded training: the recipe both front doors share, and what it tells the flat parameters.

| precision    | gathered, computed in     | master shard | grads kept in | reduced in (default) |
| ------------ | ------------------------- | ------------ | ------------- | -------------------- |
| "32-true"    | fp32                      | = the shard  | fp32          | fp32                 |
| "64-true"    | fp64 (module converted)   | = the shard  | fp64          | fp64                 |
| "bf16-mixed" | bf16 copies, autocast     | fp32         | bf16          | fp32                 |
| "16-mixed"   | fp16 copies, autocast     | fp32         | fp16          | fp32; dynamic loss scale |
| "bf16-true"  | bf16 (module converted)   | = the shard  | bf16          | bf16                 |

With "bf16-mixed" and AdamW each rank holds 2 B compute copy + 2 B gradient + 4 B master + 8 B
moments = 16 B per parameter, divided by N at stage 3 (the ZeRO table); "64-true" holds 8 + 8 + 16.
Gradient clipping takes the global norm over every rank's shards; the fp16 loss scale (torch's GradScaler,
common/grad_scaler.py) skips a step when any rank overflowed.

The plugin is Lightning's own. What a front door chose (``Trainer(precision=...)``, ``plugins=[...]``,
``Fabric(precision=...)``) is an instance of one of Lightning's plugin classes (``Precision``, ``DoublePrecision``,
``HalfPrecision``, ``MixedPrecision``) or of a user's subclass of one; ``convert_plugin`` keeps that object and
gives it a subclass of its class that puts ``PrecisionRecipe`` in front (``sharded_class``). So what DDP exposes
stays true: ``trainer.precision_plugin`` is the object the user passed, ``isinstance`` against Lightning's
classes and the user's holds, ``.device``, ``.scaler``, the class name (and so the checkpoint key) are
Lightning's, and everything the recipe leaves alone — autocast (the user's ``autocast_context_manager``), input
conversion, the module's dtype, the loss scaling before backward — is the class's own code. The recipe
overrides only what sharding changes: which tensors hold the gradients (the master shards), clipping by the
global norm, and the fp16 step, which unscales once and skips on every rank when any rank overflowed.
trainer/precision.py adds the Trainer's hooks and fabric/precision.py Fabric's, so the two plugins differ only
where Lightning's two APIs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.common.grad_scaler import ShardedGradScaler
from lightning_shardlab.core.config import REDUCE_DTYPES, PrecisionPolicy
from lightning_shardlab.sharding.optimizer import clip_grad_norm_

if TYPE_CHECKING:
    from lightning_shardlab.sharding.sharded_model import ShardedModel

SUPPORTED = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true")
COMPUTE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class PrecisionRecipe(FabricPrecision):
    """Global clipping and the fp16 loss scale over the master shards, in front of one of Lightning's plugins.

    An instance is always one of Lightning's plugin objects taken over by ``convert_plugin`` (its ``__init__``
    ran as Lightning's or the user's class wrote it), so the recipe keeps its own state in class defaults
    until ``take_over`` sets it."""

    norm_type: float = 2.0
    last_grad_norm: Tensor | None = None
    _sharded: ShardedModel | None = None
    _device_type: str = "cpu"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (the trainer sent to ranks started by spawn) as Lightning's class with the recipe put in front
        again where it is loaded: ``sharded_class`` names its class like Lightning's, under which pickle finds
        Lightning's own class, not this one. Its state follows (pickle's third item), so cycles through it hold."""
        cls = type(self)
        if _SHARDED.get(cls.__bases__[::-1]) is not cls:
            return super().__reduce_ex__(protocol)
        return _taken_over, cls.__bases__[::-1], self.__getstate__()

    def take_over(self, norm_type: float) -> None:
        """Become the shardlab plugin (``convert_plugin``): the scaler, if any, reduces its overflow flag over the
        ranks and unscales the master shards (common/grad_scaler.py); it stays the same object."""
        self.norm_type = norm_type
        if self.loss_scaler is not None:
            self.scaler = ShardedGradScaler.adopt(self.loss_scaler, self.main_params)

    @property
    def loss_scaler(self) -> ShardedGradScaler | None:
        """``.scaler`` where Lightning's MixedPrecision keeps it ("16-mixed"); the other plugins have none."""
        return getattr(self, "scaler", None)

    @property
    def device_type(self) -> str:
        """For autocast and the scaler: MixedPrecision's ``.device``; the strategy sets its root device's type."""
        return getattr(self, "device", self._device_type)

    @device_type.setter
    def device_type(self, device_type: str) -> None:
        if isinstance(getattr(self, "device", None), str):
            self.device = device_type  # MixedPrecision's, read by its autocast (``ShardLabPrecision("16-mixed")``)
        self._device_type = device_type
        scaler = self.loss_scaler
        if scaler is not None and scaler.device_type != device_type:  # a GradScaler made for another device
            self.scaler = ShardedGradScaler.like(scaler, device_type, self.main_params)

    @property
    def sharded(self) -> ShardedModel | None:
        return self._sharded

    @sharded.setter
    def sharded(self, sharded: ShardedModel | None) -> None:
        """Set by the strategy once the model is sharded (the scaler reduces its overflow flag on its comm)."""
        self._sharded = sharded
        if self.loss_scaler is not None:
            self.loss_scaler.sharded = sharded

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return COMPUTE.get(self.precision)

    def policy(self, reduce_dtype: str | None) -> PrecisionPolicy:
        return PrecisionPolicy(self.compute_dtype, REDUCE_DTYPES[reduce_dtype] if reduce_dtype else None)

    # ---- gradients: global clipping, fp16 loss scaling ----

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        """What the gradients are read from: the master views of the optimizer's parameters (clip by value)."""
        assert self.sharded is not None
        return self.sharded.masters(super().main_params(optimizer))

    def clip_by_global_norm(self, optimizer: Optimizer, max_norm: float, norm_type: float | None = None) -> Tensor:
        """Collective: clip ``optimizer``'s gradients by their global norm; returns the norm before clipping."""
        assert self.sharded is not None, "the strategy connects the precision plugin before training"
        params = self.main_params(optimizer)
        norm = self.norm_type if norm_type is None else norm_type
        self.last_grad_norm = clip_grad_norm_(params, max_norm, norm, self.sharded.mesh.shard)
        return self.last_grad_norm

    def _step_or_skip(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """After unscaling: the scaler steps, or (any rank overflowed) skips the step on every rank and drops its
        gradients; then it updates the scale, as Lightning's MixedPrecision does."""
        scaler = self.loss_scaler
        assert scaler is not None and self.sharded is not None
        overflow = scaler.overflowed(optimizer)
        stepped = scaler.step(optimizer, **kwargs)
        scaler.update()
        if overflow:
            self.sharded.skip_step()
        return stepped


@dataclass(frozen=True)
class Family:
    """One front door's plugin classes: Lightning's, each with the precisions shardlab trains it in, and the
    shardlab base class (``ours``) that ``convert_plugin`` puts in front of them."""

    front_door: str  # "Trainer" or "Fabric": how refusals name what was passed
    ours: type[PrecisionRecipe]
    plain: type[FabricPrecision]
    double: type[FabricPrecision]
    half: type[FabricPrecision]
    mixed: type[FabricPrecision]

    def precisions(self) -> dict[type, tuple[str, ...]]:
        return {
            self.plain: ("32-true",),
            self.double: ("64-true",),
            self.half: ("bf16-true",),
            self.mixed: ("bf16-mixed", "16-mixed"),
        }

    def plugin(self, precision: str, scaler: torch.amp.GradScaler | None = None) -> FabricPrecision:
        """Lightning's plugin for ``precision``, as its connector makes it (autocast on the CPU until the strategy
        sets its device)."""
        if precision in COMPUTE:
            return self.mixed(precision, "cpu", scaler)  # type: ignore[call-arg]
        if precision in ("bf16-true", "16-true"):
            return self.half(precision)  # type: ignore[call-arg]
        makers = {"32-true": self.plain, "64-true": self.double}
        if precision not in makers:
            raise ValueError(
                f"[rank {rank_zero_only.rank}] `{self.ours.__name__}(precision={precision!r})` is not a precision."
                f" HINT: one of {', '.join(SUPPORTED)}."
            )
        return makers[precision]()


_SHARDED: dict[tuple[type, type], type] = {}


def sharded_class(cls: type, base: type[PrecisionRecipe]) -> type:
    """A subclass of the plugin's class ``cls`` with ``base`` (the front door's recipe) in front, under ``cls``'s
    own name, qualname and module: ``type(plugin).__name__``, ``repr`` and the key Lightning files the plugin's
    ``state_dict()`` under in a checkpoint stay what they are under DDP. One class per (``cls``, ``base``)."""
    key = (cls, base)
    if key not in _SHARDED:
        names = {"__name__": cls.__name__, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
        _SHARDED[key] = type(cls.__name__, (base, cls), {**names, "__doc__": cls.__doc__})
    return _SHARDED[key]


def _taken_over(cls: type, base: type[PrecisionRecipe]) -> Any:
    """Unpickling: an empty instance of ``sharded_class(cls, base)``; pickle then gives it its state."""
    return object.__new__(sharded_class(cls, base))


def lightning_class(cls: type) -> type | None:
    """The first of Lightning's own classes ``cls`` is or derives from (a user's subclass: the class it extends)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("lightning.")), None)


def convert_plugin(plugin: Any, family: Family, norm_type: float) -> Any:
    """The shardlab plugin for what a front door chose: the same object (``None``: Lightning's fp32 plugin), its
    class now ``sharded_class``'s. It must be an instance of one of Lightning's plain plugins, or of a subclass
    of one, in a precision of ``SUPPORTED``; anything else is refused, saying what was passed."""
    if isinstance(plugin, family.ours):
        return plugin
    plugin = family.plugin("32-true") if plugin is None else plugin
    refuse_unless_supported(plugin, family)
    plugin.__class__ = sharded_class(type(plugin), family.ours)
    plugin.take_over(norm_type)
    return plugin


def refuse_unless_supported(plugin: Any, family: Family) -> None:
    """Raise (before any collective: at the Trainer's or Fabric's construction) unless ``family`` drives
    ``plugin``; the message names the plugin's class and its precision as they were passed."""
    cls, precision = type(plugin), getattr(plugin, "precision", None)
    theirs = lightning_class(cls)
    allowed = family.precisions().get(theirs)  # type: ignore[call-overload]
    if allowed is not None and precision in allowed:
        return
    if cls is theirs:
        passed = f"precision={precision!r} (Lightning's {cls.__name__} plugin)"
    else:
        extends = f", a subclass of Lightning's {theirs.__name__}" if theirs is not None else ""
        passed = f"the precision plugin {cls.__qualname__} (precision={precision!r}{extends})"
    if allowed is not None:
        why = f"the shardlab strategy trains {theirs.__name__} in {', '.join(allowed)} only"  # type: ignore[union-attr]
    else:
        why = "the shardlab strategy drives Lightning's Precision, DoublePrecision, HalfPrecision and MixedPrecision"
        why += " (and subclasses of them), not other strategies' plugins"
    raise ValueError(
        f"[rank {rank_zero_only.rank}] {passed} is not supported: {why}."
        f" HINT: `{family.front_door}(precision=...)` with one of {', '.join(SUPPORTED)}, or a subclass of one of"
        " those four classes in one of them."
    )
