"""lightning_shardlab: fully sharded data parallel training (ZeRO stages 1-3) for PyTorch Lightning.

Importing the package registers the strategy names "shardlab" (stage 3), "shardlab_stage_1",
"shardlab_stage_2" and "shardlab_stage_3" with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shardlab.budget_report import ShardLabBudget
from lightning_shardlab.checkpoint_files import CheckpointError
from lightning_shardlab.collectives import Comm
from lightning_shardlab.config import Accumulation, ShardLabConfig, Stage
from lightning_shardlab.ema import ShardLabEMA
from lightning_shardlab.optimizer import shard_optimizer
from lightning_shardlab.sanity_callback import ShardLabSanity
from lightning_shardlab.sanity_guard import SanityConfig, SanityGuard
from lightning_shardlab.shard_model import ShardedModel, shard_model
from lightning_shardlab.strategy import ShardLabStrategy
from lightning_shardlab.vitals import ShardLabVitals

ShardLabStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Accumulation",
    "CheckpointError",
    "Comm",
    "ShardLabBudget",
    "SanityConfig",
    "SanityGuard",
    "ShardLabConfig",
    "ShardLabEMA",
    "ShardLabSanity",
    "ShardLabStrategy",
    "ShardLabVitals",
    "ShardedModel",
    "Stage",
    "shard_model",
    "shard_optimizer",
]
__version__ = "0.1.0"
