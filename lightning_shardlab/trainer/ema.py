"""``ShardLabEMA``: an exponential moving average of the weights for ``ShardLabStrategy``, kept sharded.

    trainer = L.Trainer(strategy="shardlab", callbacks=[ShardLabEMA(decay=0.999)])
    trainer.fit(model, data)                       # validation runs on the average
    averaged = trainer.strategy.full_state_dict(ema=True)

Each rank averages its own master shards (sharding/averages.py): 1/N of the memory of a full copy, and no
communication per update. The rule, its start and its schedule are those of Lightning's
``EMAWeightAveraging`` (torch's ``AveragedModel`` with ``get_ema_avg_fn``), so the two give the same
numbers:

    fit start        the average is a copy of the weights
    update           after an optimizer step, when ``step_idx = trainer.global_step - 1`` is at least
                     ``start_step`` (if given) and a multiple of ``every_n_steps``; or at the end of an
                     epoch at least ``start_epoch`` (if given). The first update copies the weights, later
                     ones take decay * average + (1 - decay) * weights (buffers too, with ``use_buffers``)
    evaluation       with ``swap_eval``, validation and test loops run on the average; the weights come
                     back bit for bit after each loop
    end of fit       with ``apply_at_end``, the weights take the average's values (Lightning's callback
                     always does this)

Checkpoints (sharded, full, consolidated) carry the average, and it is resharded at load to any world
size and stage. Lightning's own ``WeightAveraging`` callbacks (and users' subclasses) run on the same sharded
average (trainer/weight_averaging.py).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_shardlab.core.config import check_bool, check_in_range, check_int
from lightning_shardlab.sharding.averages import Averages
from lightning_shardlab.sharding.lookup import sharded_model_of
from lightning_shardlab.sharding.sharded_model import ShardedModel


class ShardLabEMA(L.Callback):
    """Exponential moving average of the weights, sharded like them (see the module docstring).

    Args:
        decay: the weight of the old average in each update, in [0, 1].
        every_n_steps: update after every K-th optimizer step.
        start_step: the first optimizer step (0-based) that updates; None: from the first.
        start_epoch: also update at the end of every epoch from this one on; None: never at epoch ends.
        use_buffers: average the buffers too (BatchNorm statistics); False: the average keeps the
            buffers' values of its last update.
        swap_eval: run validation and test loops on the average.
        apply_at_end: at the end of fit, the weights take the average's values.
    """

    def __init__(
        self,
        decay: float = 0.999,
        every_n_steps: int = 1,
        start_step: int | None = None,
        start_epoch: int | None = None,
        use_buffers: bool = True,
        swap_eval: bool = True,
        apply_at_end: bool = True,
    ) -> None:
        check_in_range("decay", decay, 0, 1)
        check_int("every_n_steps", every_n_steps, 1)
        for name, value in (("start_step", start_step), ("start_epoch", start_epoch)):
            if value is not None:
                check_int(name, value, 0, " (or None)")
        for name, value in (("use_buffers", use_buffers), ("swap_eval", swap_eval), ("apply_at_end", apply_at_end)):
            check_bool(name, value)
        self.decay, self.every_n_steps = float(decay), every_n_steps
        self.start_step, self.start_epoch = start_step, start_epoch
        self.use_buffers, self.swap_eval, self.apply_at_end = use_buffers, swap_eval, apply_at_end
        self.sharded: ShardedModel | None = None
        self.latest_update_step = 0  # trainer.global_step at the last update
        self.latest_update_epoch = -1
        self._swapped = False  # the average is in the model (during an evaluation loop)
        self._applied = False  # the model holds the average for good (after fit, apply_at_end)

    @property
    def averages(self) -> Averages | None:
        return None if self.sharded is None else self.sharded.averages

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """EMAWeightAveraging.should_update: by step, or by epoch when ``start_epoch`` is set."""
        if step_idx is not None and (self.start_step is None or step_idx >= self.start_step):
            if step_idx % self.every_n_steps == 0:
                return True
        return epoch_idx is not None and self.start_epoch is not None and epoch_idx >= self.start_epoch

    # ---- fit ----

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sharded = sharded = sharded_model_of(trainer, required_by="ShardLabEMA")
        sharded.averages = Averages(sharded, self.use_buffers)  # a checkpoint being resumed replaces it
        self._applied = False

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step > self.latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._update()
            self.latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch > self.latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update()
            self.latest_update_epoch = trainer.current_epoch

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.apply_at_end and self.averages is not None:
            assert self.sharded is not None
            self.averages.apply(self.sharded)
            self._applied = True

    def _update(self) -> None:
        assert self.sharded is not None and self.averages is not None
        self.averages.update(self.sharded, self.decay)

    # ---- evaluation on the average ----

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_in()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_out()

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_in()

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._swap_out()

    def _swap_in(self) -> None:
        if self.swap_eval and not self._applied and not self._swapped and self.averages is not None:
            assert self.sharded is not None
            self.averages.swap(self.sharded)
            self._swapped = True

    def _swap_out(self) -> None:
        if self._swapped:
            assert self.sharded is not None and self.averages is not None
            self.averages.swap(self.sharded)
            self._swapped = False

    # ---- checkpoints: the average itself travels with the model state (sharding/averages.py) ----

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self.latest_update_step, "latest_update_epoch": self.latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.latest_update_step = state_dict["latest_update_step"]
        self.latest_update_epoch = state_dict.get("latest_update_epoch", -1)
