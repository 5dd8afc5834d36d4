"""Models for the tests, by kind; every name is importable from ``tests.models`` too."""

from tests.models.basic import Block, Gate, OddNet, regression_batches
from tests.models.gpt import OrderedData, TinyGPT, global_batches, token_dataset
from tests.models.loops import ByIndex, Checkpointed, DictValues, Looped, Reused, SkipsOne
from tests.models.meta import Block2, WideBlocks
from tests.models.parity import (
    AdafactorGPT,
    BranchyNet,
    ConvBlock,
    GroupedGPT,
    ManualNet,
    MuonGPT,
    ParityModule,
    RegressionNet,
    TinyCNN,
    image_dataset,
    regression_dataset,
)
from tests.models.routing import Expert, Extra, MoEBlock, MoELayer, MoENet, RankOneExtra, SwappedBlocks

__all__ = [
    "Block",
    "Gate",
    "OddNet",
    "regression_batches",
    "TinyGPT",
    "token_dataset",
    "OrderedData",
    "global_batches",
    "ParityModule",
    "RegressionNet",
    "GroupedGPT",
    "ConvBlock",
    "TinyCNN",
    "ManualNet",
    "MuonGPT",
    "AdafactorGPT",
    "BranchyNet",
    "regression_dataset",
    "image_dataset",
    "WideBlocks",
    "Block2",
    "Expert",
    "MoELayer",
    "MoEBlock",
    "MoENet",
    "RankOneExtra",
    "Extra",
    "SwappedBlocks",
    "Looped",
    "DictValues",
    "Checkpointed",
    "Reused",
    "SkipsOne",
    "ByIndex",
]
