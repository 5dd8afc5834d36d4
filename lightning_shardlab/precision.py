"""Lightning's precision plugin, made shard-aware: gradient clipping by the global norm.

Lightning clips through ``Precision.clip_gradients``; the plain plugin would take the norm of this
rank's shard only. This plugin takes the norm over every rank's shards (one all-reduce), so the
clipped gradients, and the norm, equal DDP's.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shardlab.collectives import Comm
from lightning_shardlab.optimizer import clip_grad_norm_

SUPPORTED = ("32-true",)


class ShardLabPrecision(Precision):
    def __init__(self, precision: str = "32-true", norm_type: float = 2.0) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"`precision={precision!r}` is not supported by the shardlab strategy. Allowed: {', '.join(SUPPORTED)}."
            )
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.norm_type = norm_type
        self.comm: Comm | None = None  # set by the strategy once the process group exists
        self.last_grad_norm: Any = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        assert self.comm is not None, "the strategy connects the precision plugin before training"
        self.last_grad_norm = clip_grad_norm_(list(self.main_params(optimizer)), clip_val, self.norm_type, self.comm)


def shardlab_precision(plugin: Precision | None, norm_type: float) -> ShardLabPrecision:
    """The shardlab plugin for what the Trainer chose (``precision=...``); refuses what it cannot honour."""
    if plugin is None or isinstance(plugin, ShardLabPrecision):
        return plugin or ShardLabPrecision(norm_type=norm_type)
    if type(plugin) is Precision:
        return ShardLabPrecision("32-true", norm_type)
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"`Trainer(precision={name!r})` is not supported by the shardlab strategy. Allowed: {', '.join(SUPPORTED)}."
    )
