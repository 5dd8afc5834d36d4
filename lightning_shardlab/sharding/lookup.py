"""A Trainer's sharded model, for the callbacks: the strategy imports them, not the other way round, so each
finds the model through the trainer it is handed.
"""

from __future__ import annotations

from typing import Any

from lightning_shardlab.sharding.sharded_model import ShardedModel


def sharded_model_of(trainer: Any, required_by: str | None = None) -> ShardedModel | None:
    """The sharded model of ``trainer``: None under another strategy (or before setup), unless ``required_by``
    names who needs it, then a clear error."""
    sharded = getattr(trainer.strategy, "sharded", None)
    if isinstance(sharded, ShardedModel) or required_by is None:
        return sharded if isinstance(sharded, ShardedModel) else None
    raise ValueError(
        f"{required_by} needs the shardlab strategy, got {type(trainer.strategy).__name__}. HINT: pass"
        " strategy=ShardLabStrategy(...) (or 'shardlab') to the Trainer."
    )
