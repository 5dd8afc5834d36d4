"""Fabric's front door: ``L.Fabric(strategy="shardlab")`` trains litgpt-style loops fully sharded, on the same
engine as the Trainer (nothing of it is written twice).

    strategy.py   ``ShardLabStrategy``: Fabric's hooks onto the engine (setup, backward, no_backward_sync,
                  clipping, collectives, save and load)
    precision.py  ``ShardLabFabricPrecision``: the precision recipe on Fabric's plugin hooks
    spawn_launcher.py  ``fabric.launch(train)`` with ranks started by spawn or fork: refusals before they start

Importing ``lightning_shardlab`` registers "shardlab", "shardlab_stage_1", "shardlab_stage_2" and
"shardlab_stage_3" with Fabric as well as with the Trainer.
"""

from lightning_shardlab.fabric.precision import ShardLabFabricPrecision
from lightning_shardlab.fabric.strategy import ShardLabStrategy

__all__ = ["ShardLabFabricPrecision", "ShardLabStrategy"]
