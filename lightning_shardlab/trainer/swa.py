"""``ShardLabSWA``: Lightning's ``StochasticWeightAveraging`` with the average kept sharded, at every stage.

    trainer = L.Trainer(strategy="shardlab", callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])  # as under DDP

Lightning's callback keeps a deep copy of the whole module on every rank and reads every weight, which at stage 3
no rank holds. ``ShardLabSWA`` is that callback, subclassed: its schedule is Lightning's own code, unchanged
(``swa_epoch_start``, the ``SWALR`` scheduler swapped in with its annealing, the update at each averaged epoch's
start, the batch-norm pass of one more epoch at the end, the averaged weights swapped in when fit ends, its state
in checkpoints). Only the three places that touch the whole model are changed:

    setup              no deep copy: the average is this rank's slice of every flat parameter
                       (sharding/averages.py, the same state ``ShardLabEMA`` keeps)
    update_parameters  ``avg_fn(average, weights, n_averaged)`` on this rank's master shards (elementwise, so
                       the slices of the unsharded average, bit for bit)
    transfer_weights   the master shards take the average (the parameters; buffers stay, as in Lightning's)

The average travels in checkpoints with the weights (sharded, full and consolidated), is resharded at load to
any world size and stage, and ``trainer.strategy.full_state_dict(ema=True)`` returns it. The strategy turns a
``StochasticWeightAveraging`` it is given into this class, in place (the user's object, its arguments kept), and a
user's subclass into that subclass over this one (trainer/averaging_subclasses.py): its own methods run, and their
``super()`` calls reach these.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor

from lightning_shardlab.sharding.averages import Averages
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.trainer.average_readers import StandIn

# what a subclass may ask of ``_average_model`` and get what it gets under DDP (trainer/average_readers.py); its
# ``state_dict`` is Lightning's own business (the average's values travel with the weights, not in it)
STAND_IN_API = frozenset({"to"})
# the methods SWA hands the average, and where (after ``self``)
AVERAGE_ARGUMENTS = {"update_parameters": 0, "transfer_weights": 0}


class AverageInShards(StandIn):
    """What Lightning's callback holds as ``_average_model``: it moves it and asks its state; the average itself
    is the sharded model's ``Averages``, and its state travels with the weights in checkpoints. Anything else is a
    read of the whole averaged module, refused by ``StandIn``."""

    def to(self, *args: Any, **kwargs: Any) -> AverageInShards:
        return self

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state_dict: Any) -> None:
        pass


class ShardLabSWA(StochasticWeightAveraging):
    """``StochasticWeightAveraging`` (same arguments) whose average is kept sharded; see the module docstring."""

    sharded: ShardedModel | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._average_model = AverageInShards()  # type: ignore[assignment]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sharded = sharded = sharded_model_of(trainer, required_by="StochasticWeightAveraging")
        sharded.averages = Averages(sharded, use_buffers=False)  # a checkpoint being resumed replaces it
        super().on_fit_start(trainer, pl_module)

    def update_parameters(self, average_model: Any, model: Any, n_averaged: Tensor, avg_fn: Any) -> None:  # type: ignore[override]
        assert self.sharded is not None and self.sharded.averages is not None
        self.sharded.averages.update_with(self.sharded, avg_fn, n_averaged)
        n_averaged += 1

    def transfer_weights(self, src_pl_module: Any, dst_pl_module: Any) -> None:  # type: ignore[override]
        assert self.sharded is not None and self.sharded.averages is not None
        self.sharded.averages.apply(self.sharded, buffers=False)
