"""Fabric's precision plugin: the recipe of common/precision.py on Fabric's hooks.

What ``Fabric(precision=...)`` (or ``plugins=[...]``) chose stays Lightning's plugin object and becomes a
``ShardLabFabricPrecision`` too (``fabric_precision``; common/precision.py explains how), so
``fabric.strategy.precision`` is a ``MixedPrecision`` under "bf16-mixed" as under DDP. Under "16-mixed" the loss
is scaled by MixedPrecision's ``backward``; the gradients are unscaled once per step (by ``clip_gradients`` if
it runs first, else by the optimizer step), and a step that overflowed on any rank is skipped on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.common.precision import Family, PrecisionRecipe, convert_plugin


class ShardLabFabricPrecision(PrecisionRecipe):
    """Fabric's plugin. ``ShardLabFabricPrecision("bf16-mixed")`` makes Lightning's plugin and takes it over."""

    def __new__(cls, precision: str = "32-true", norm_type: float = 2.0, scaler: Any = None) -> Any:
        if cls is not ShardLabFabricPrecision:  # a taken-over class (a copy of a plugin): a plain instance
            return super().__new__(cls)
        return fabric_precision(FABRIC.plugin(precision, scaler), norm_type)

    def __init__(
        self, precision: str = "32-true", norm_type: float = 2.0, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """Nothing to do: ``__new__`` returned Lightning's plugin, initialised by its class and taken over."""

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        scaler = self.loss_scaler
        if scaler is not None and not scaler.unscaled(optimizer):
            scaler.unscale_(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.loss_scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)
        return self._step_or_skip(optimizer, **kwargs)


FABRIC = Family("Fabric", ShardLabFabricPrecision, Precision, DoublePrecision, HalfPrecision, MixedPrecision)


def fabric_precision(plugin: Precision | None, norm_type: float) -> ShardLabFabricPrecision:
    """The shardlab plugin for what Fabric chose (``Fabric(precision=...)``): the same object."""
    return convert_plugin(plugin, FABRIC, norm_type)
