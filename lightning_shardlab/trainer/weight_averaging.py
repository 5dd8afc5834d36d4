"""``ShardLabWeightAveraging``: Lightning's ``WeightAveraging`` (and ``EMAWeightAveraging``) with the average sharded.

    trainer = L.Trainer(strategy="shardlab", callbacks=[EMAWeightAveraging(decay=0.999)])  # as under DDP

Lightning's callback keeps an ``AveragedModel`` (a deep copy of the whole module) on every rank and reads every
weight, which at stage 3 no rank holds. This class sits between a user's class and ``WeightAveraging`` in the MRO
(trainer/averaging_subclasses.py builds that class), so Lightning's own hooks run unchanged and call what the
user overrides (``should_update``, any hook that calls ``super()``). Only the places that touch the whole model
are changed:

    setup                 no deep copy: ``_average_model`` is ``AveragedShards``, a stand-in for the AveragedModel
    on_fit_start          the average is made: this rank's slice of every flat parameter, and the buffers
                          (sharding/averages.py, the same state ``ShardLabEMA`` keeps)
    update_parameters     (the stand-in's, which Lightning's hooks call) torch's own ``AveragedModel`` update with
                          the user's ``avg_fn`` / ``multi_avg_fn``, on this rank's master shards
    _swap_models          validation runs on the average: weights and buffers exchanged, bit for bit both ways
    _copy_average_to_current   at the end of fit the weights and buffers take the average
    on_save_checkpoint / on_load_checkpoint   the average travels with the weights, as ``ShardLabEMA``'s does
                          (checkpoint/save_load.py), resharded at load to any world size and stage

``trainer.strategy.full_state_dict(ema=True)`` returns the average. The average lives beside the master shards
(1/N of a copy per rank), whatever ``device`` the callback was given.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import WeightAveraging
from torch import Tensor

from lightning_shardlab.sharding.averages import Averages
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.trainer.average_readers import StandIn

# what a subclass may ask of ``_average_model`` and get what it gets under DDP (trainer/average_readers.py)
STAND_IN_API = frozenset({"update_parameters", "to", "n_averaged"})


class AveragedShards(StandIn):
    """What ``WeightAveraging`` holds as ``_average_model``: the update it asks for runs on this rank's share;
    anything else is a read of the whole averaged module, refused by ``StandIn``."""

    def __init__(self, trainer: L.Trainer, name: str, use_buffers: bool, kwargs: dict[str, Any]) -> None:
        self.trainer, self.name, self.use_buffers = trainer, name, use_buffers
        self.avg_fn, self.multi_avg_fn = kwargs.get("avg_fn"), kwargs.get("multi_avg_fn")
        self.averages: Averages | None = None

    @property
    def sharded(self) -> ShardedModel:
        sharded = sharded_model_of(self.trainer, required_by=self.name)
        assert sharded is not None
        return sharded

    def start(self) -> Averages:
        """A new average of the current weights (each fit starts one, as Lightning's setup deep-copies the
        module); a checkpoint being resumed replaces its values."""
        sharded = self.sharded
        self.averages = sharded.averages = Averages(sharded, self.use_buffers)
        return self.averages

    def started(self) -> Averages:
        return self.averages if self.averages is not None else self.start()  # on_fit_start overridden, no super()

    def update_parameters(self, model: Any) -> None:
        self.started().update_like_torch(self.sharded, self.avg_fn, self.multi_avg_fn)

    def to(self, *args: Any, **kwargs: Any) -> AveragedShards:
        return self  # the average stays beside the master shards

    @property
    def n_averaged(self) -> Tensor:
        return torch.tensor(0 if self.averages is None else self.averages.n_averaged, dtype=torch.long)


class ShardLabWeightAveraging(WeightAveraging):
    """``WeightAveraging`` whose average is kept sharded; see the module docstring."""

    def _stand_in(self) -> AveragedShards:
        assert isinstance(self._average_model, AveragedShards), "the average is made at setup('fit')"
        return self._average_model

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # as Lightning's: only fit makes an average
            self._average_model = AveragedShards(  # type: ignore[assignment]
                trainer, type(self).__name__, self._use_buffers, self._kwargs
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._stand_in().start()  # before a checkpoint is restored (the strategy restores after this hook)

    def _swap_models(self, pl_module: L.LightningModule) -> None:
        stand_in = self._stand_in()
        stand_in.started().swap(stand_in.sharded)

    def _copy_average_to_current(self, pl_module: L.LightningModule) -> None:
        stand_in = self._stand_in()
        stand_in.started().apply(stand_in.sharded, buffers=True)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        pass  # the average is saved with the weights (checkpoint/save_load.py), as ShardLabEMA's

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The average was loaded with the weights; a checkpoint Lightning's callback wrote under another strategy
        holds the average as its ``state_dict`` and the weights beside it, which this run cannot tell apart."""
        if "current_model_state" in checkpoint:
            raise ValueError(
                f"{type(self).__name__}: this checkpoint was written by Lightning's weight averaging under another"
                " strategy (its state_dict is the average, current_model_state the weights); shardlab resumes the"
                " average only from its own checkpoints. HINT: resume it under the strategy that wrote it, or start"
                " from its weights: trainer.strategy.load_raw(path) on the checkpoint's current_model_state saved"
                " as a state dict file."
            )
