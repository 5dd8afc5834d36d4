"""A user's ``CheckpointIO`` plugin writes the checkpoints, as under DDP.

Lightning hands every save and load to the strategy's ``checkpoint_io``; a user passes a plugin of their own
(``Trainer(plugins=[MyIO()])``, a ``TorchCheckpointIO`` subclass that uploads, records or encrypts) to be asked
for each one. A sharded checkpoint is written by shardlab itself (each rank its own files, atomically: a model
file and a shard directory), so such a plugin would never be called. By default, then, a run with a plugin of
the user's writes ``state_dict_type="full"`` checkpoints (one plain Lightning file each, gathered and handed to
the plugin by rank 0, as DDP's are), and says so once. Asking for ``state_dict_type="sharded"`` by name, or
wrapping the plugin in ``AsyncCheckpointIO`` (whose background writes are sharded here), keeps sharded
checkpoints, with a warning that the plugin is not called for them.
"""

from __future__ import annotations

import dataclasses

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_shardlab.core.config import ShardLabConfig


def users_plugin(io: CheckpointIO | None) -> CheckpointIO | None:
    """The plugin of the user's inside ``io`` (a wrapper's inner one too), or None when it is Lightning's own."""
    inner = io.checkpoint_io if isinstance(io, _WrappingCheckpointIO) else io
    return None if inner is None or type(inner) is TorchCheckpointIO else inner


def settle_state_dict_type(config: ShardLabConfig, io: CheckpointIO | None, asked: bool) -> ShardLabConfig:
    """``config`` with the checkpoint format a run with ``io`` writes; ``asked``: the user named
    ``state_dict_type``. No collective: every rank decides the same from the same plugin."""
    plugin = users_plugin(io)
    if plugin is None or config.state_dict_type == "full":
        return config
    name = type(plugin).__name__
    if asked or isinstance(io, AsyncCheckpointIO):
        asked_for = f"state_dict_type={config.state_dict_type!r} was asked for"
        why = asked_for if asked else "AsyncCheckpointIO writes sharded checkpoints"
        what = "a DCP directory" if config.state_dict_type == "dcp" else "a model file and its shard directory"
        rank_zero_warn(
            f"{name}.save_checkpoint/load_checkpoint are not called: {why}, and shardlab writes that checkpoint"
            f" ({what}) itself. HINT: leave state_dict_type unset (or 'full'), without"
            f" AsyncCheckpointIO, to have {name} write every checkpoint as one file, as under DDP."
        )
        return config
    rank_zero_info(
        f"shardlab: checkpoints are written through your {name} as one file each (state_dict_type='full', as"
        " under DDP); pass state_dict_type='sharded' for sharded checkpoints, which it would not write."
    )
    return dataclasses.replace(config, state_dict_type="full")
