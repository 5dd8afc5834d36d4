"""The Trainer's precision plugin: ``Trainer(precision=...)`` becomes a ``ShardLabPrecision``.

The recipe (common/precision.py) on the Trainer's hooks: gradient clipping by the global norm over every rank's
shards, and under "16-mixed" the optimizer step that unscales once and skips a step any rank overflowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.common.precision import PrecisionRecipe, convert_plugin


class ShardLabPrecision(PrecisionRecipe, Precision):
    """The Trainer's plugin: ``Trainer(precision=...)`` becomes one of these (``shardlab_precision``)."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.clip_by_global_norm(optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.loss_scale is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # backward was skipped
        overflow = self._unscale(optimizer)
        self._after_closure(model, optimizer)
        stepped = self._step_or_skip(optimizer, overflow, **kwargs)
        return closure_result if overflow else stepped


def shardlab_precision(plugin: Precision | None, norm_type: float) -> ShardLabPrecision:
    """The shardlab plugin for what the Trainer chose (``precision=...``)."""
    return convert_plugin(plugin, ShardLabPrecision, (Precision, MixedPrecision, HalfPrecision), norm_type, "Trainer")
