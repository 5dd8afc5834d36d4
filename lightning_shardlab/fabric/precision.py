"""Fabric's precision plugin: the recipe of common/precision.py on Fabric's hooks.

``Fabric(precision="bf16-mixed")`` (or "32-true", "16-mixed", "bf16-true") becomes a
``ShardLabFabricPrecision``; the strategy converts what Fabric chose (``fabric_precision``). Under "16-mixed"
the loss is scaled before backward; the gradients are unscaled once per step (by ``clip_gradients`` if it
runs first, else by the optimizer step), and a step that overflowed on any rank is skipped on every rank.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.common.precision import PrecisionRecipe, convert_plugin


class ShardLabFabricPrecision(PrecisionRecipe):
    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None and not self.scaler.unscaled(optimizer):
            self.scaler.unscale_(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)
        return self._step_or_skip(optimizer, **kwargs)


def fabric_precision(plugin: Precision | None, norm_type: float) -> ShardLabFabricPrecision:
    """The shardlab plugin for what Fabric chose (``Fabric(precision=...)``)."""
    lightning = (Precision, MixedPrecision, HalfPrecision)
    return convert_plugin(plugin, ShardLabFabricPrecision, lightning, norm_type, "Fabric")
