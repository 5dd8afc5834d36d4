"""The Trainer's precision plugin: what ``Trainer(precision=...)`` or ``plugins=[...]`` chose, taken over.

The plugin stays Lightning's object (or the user's, a subclass of Lightning's MixedPrecision, HalfPrecision,
DoublePrecision or Precision) and becomes a ``ShardLabPrecision`` too (common/precision.py explains how):
gradient clipping by the global norm over every rank's shards, and under "16-mixed" Lightning's
MixedPrecision step with the plugin's GradScaler at ``.scaler`` (common/grad_scaler.py): it unscales once and
skips a step any rank overflowed; its state is in checkpoints where Lightning keeps it (under the plugin's
class name, as under DDP).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.common.precision import Family, PrecisionRecipe, convert_plugin


class ShardLabPrecision(PrecisionRecipe, Precision):
    """The Trainer's plugin. ``ShardLabPrecision("16-mixed")`` (any of ``SUPPORTED``) makes Lightning's plugin for
    that precision and takes it over, so it is a ``MixedPrecision`` there as ``Trainer(precision=...)``'s is."""

    def __new__(cls, precision: str = "32-true", norm_type: float = 2.0, scaler: Any = None) -> Any:
        if cls is not ShardLabPrecision:  # a taken-over class (a copy of a plugin): a plain instance
            return super().__new__(cls)
        return shardlab_precision(TRAINER.plugin(precision, scaler), norm_type)

    def __init__(
        self, precision: str = "32-true", norm_type: float = 2.0, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """Nothing to do: ``__new__`` returned Lightning's plugin, initialised by its class and taken over."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_by_global_norm(optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's MixedPrecision.optimizer_step, with the sharded scaler (common/grad_scaler.py)."""
        if self.loss_scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # backward was skipped
        self.loss_scaler.unscale_(optimizer)  # before clipping (on_before_optimizer_step sees unscaled gradients)
        self._after_closure(model, optimizer)
        return self._step_or_skip(optimizer, **kwargs)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning loads the scaler's state from the key of the plugin's class name; an older shardlab checkpoint
        kept it under ``ShardLabPrecision``, and a Lightning 1.x one under ``native_amp_scaling_state``."""
        super().on_load_checkpoint(checkpoint)
        if self.loss_scaler is not None and type(self).__qualname__ not in checkpoint:
            state = checkpoint.get(ShardLabPrecision.__qualname__) or checkpoint.get("native_amp_scaling_state")
            if state:
                self.load_state_dict(state)


TRAINER = Family("Trainer", ShardLabPrecision, Precision, DoublePrecision, HalfPrecision, MixedPrecision)


def shardlab_precision(plugin: Precision | None, norm_type: float) -> ShardLabPrecision:
    """The shardlab plugin for what the Trainer chose (``precision=...`` or ``plugins=[...]``): the same object."""
    return convert_plugin(plugin, TRAINER, norm_type)
