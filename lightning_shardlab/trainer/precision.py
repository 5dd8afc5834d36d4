"""The Trainer's precision plugin: ``Trainer(precision=...)`` becomes a ``ShardLabPrecision``.

The recipe (common/precision.py) on the Trainer's hooks: gradient clipping by the global norm over every rank's
shards, and under "16-mixed" Lightning's MixedPrecision step with torch's GradScaler at ``.scaler``
(common/grad_scaler.py): it unscales once and skips a step any rank overflowed; its state is in checkpoints
where Lightning keeps it.
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
        """Lightning's MixedPrecision.optimizer_step, with the sharded scaler (common/grad_scaler.py)."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # backward was skipped
        self.scaler.unscale_(optimizer)  # before clipping (on_before_optimizer_step sees unscaled gradients)
        self._after_closure(model, optimizer)
        return self._step_or_skip(optimizer, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The scaler's state also where Lightning's MixedPrecision keeps it, for code (and DDP) reading it there."""
        if self.scaler is not None:
            checkpoint[MixedPrecision.__qualname__] = self.scaler.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of Lightning's own fp16 run (DDP's): its scaler state, under MixedPrecision's key."""
        if self.scaler is not None and type(self).__qualname__ not in checkpoint:
            state = checkpoint.get(MixedPrecision.__qualname__) or checkpoint.get("native_amp_scaling_state")
            if state:
                self.load_state_dict(state)


def shardlab_precision(plugin: Precision | None, norm_type: float) -> ShardLabPrecision:
    """The shardlab plugin for what the Trainer chose (``precision=...``)."""
    return convert_plugin(plugin, ShardLabPrecision, (Precision, MixedPrecision, HalfPrecision), norm_type, "Trainer")
