"""lightning_shardlab: fully sharded data parallel training (ZeRO stages 1-3) for PyTorch Lightning.

Importing the package registers the strategy names "shardlab" (stage 3), "shardlab_stage_1",
"shardlab_stage_2" and "shardlab_stage_3" with Lightning's Trainer and with Fabric
(``lightning_shardlab.fabric.ShardLabStrategy``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_shardlab import fabric
from lightning_shardlab.budget.callback import ShardLabBudget
from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.core.config import Accumulation, ShardLabConfig, Stage
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.sanity_guard import SanityConfig, SanityGuard
from lightning_shardlab.guard.stop_checkpoint import CheckpointOnStop
from lightning_shardlab.sharding.build import shard_model
from lightning_shardlab.sharding.optimizer import shard_optimizer
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.trainer.ema import ShardLabEMA
from lightning_shardlab.trainer.precision import ShardLabPrecision
from lightning_shardlab.trainer.strategy import ShardLabStrategy
from lightning_shardlab.trainer.swa import ShardLabSWA
from lightning_shardlab.vitals.callback import ShardLabVitals

ShardLabStrategy.register_strategies(StrategyRegistry)
fabric.ShardLabStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "CheckpointOnStop",
    "Accumulation",
    "CheckpointError",
    "Comm",
    "ShardLabBudget",
    "SanityConfig",
    "SanityGuard",
    "ShardLabConfig",
    "ShardLabEMA",
    "ShardLabSWA",
    "ShardLabPrecision",
    "ShardLabSanity",
    "ShardLabStrategy",
    "ShardLabVitals",
    "ShardedModel",
    "Stage",
    "shard_model",
    "shard_optimizer",
]
__version__ = "0.1.0"
