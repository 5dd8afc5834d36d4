"""What the engine and the features may ask of an offload tier: the slot ``ShardedModel.offload`` holds.

offload/ implements it (``HostOffload``: host memory; ``DiskOffload``: memory-mapped files) and sets the slot
at setup; the checkpoint code and the budget read it through this protocol only, so the layers below offload/
see its type without importing it.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.sharding.flat_param import FlatParam


class OffloadTier(Protocol):
    tier: str  # "host" or "disk"
    step_seconds: float  # measured: wall time inside offloaded optimizer steps (0 where nothing is timed)

    def move_masters(self) -> None:
        """Move the master shards of trainable flat parameters into the tier (once, at setup)."""

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s storage lives in this tier."""

    def attach(self, optimizer: Optimizer) -> None:
        """Make ``optimizer`` keep its state in the tier and step there."""

    def settle_all(self, optimizer: Optimizer) -> None:
        """After ``optimizer.load_state_dict``: move the loaded state where the tier keeps it."""

    def state_file(self, optimizer: Optimizer, fp: FlatParam, key: str) -> Tensor | None:
        """The tier's own tensor (a file's pages) of ``optimizer``'s state ``key`` for ``fp``; None if none."""
