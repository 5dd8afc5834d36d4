"""``ShardLabSanity``: every sanity check (guard/sanity_guard.py) for ``Trainer(strategy=ShardLabStrategy(...))``.

    trainer = L.Trainer(strategy=ShardLabStrategy(stage=3), devices=2,
                        callbacks=[ShardLabSanity(every_n_steps=10, collective_timeout_s=300)])

Before every K-th training batch: collective fingerprints, replicated state and the data check, which reads the
training DataLoader's sampler to judge equal batches (each one tiny all-gather); the watchdog from
``on_fit_start`` to the end of fit; on SIGTERM (any rank), every rank stops after the same batch and raises
Lightning's ``SIGTERMException``, as Lightning does for one rank.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_shardlab.guard.sanity_guard import SanityConfig, SanityGuard
from lightning_shardlab.sharding.lookup import sharded_model_of


class ShardLabSanity(L.Callback):
    """The sanity checks for ``Trainer(strategy=ShardLabStrategy(...))``, with every option of ``SanityConfig``.

    The one driver of the checks. The strategy adds one with its own options (``sanity_every_n_steps``, ...)
    to a Trainer that has none; with this callback in the Trainer, its options are used instead."""

    def __init__(
        self,
        every_n_steps: int = 10,
        strict_collectives: bool = False,
        verify_collectives: bool = True,
        check_replicated: bool = True,
        check_data: bool = True,
        skip_buffers: list[str] | None = None,
        collective_timeout_s: float | None = 300.0,
        heartbeat_timeout_s: float = 30.0,
        poll_s: float = 1.0,
        grace_s: float = 10.0,
        handle_sigterm: bool = True,
    ) -> None:
        self.config = SanityConfig(
            every_n_steps=every_n_steps,
            strict_collectives=strict_collectives,
            verify_collectives=verify_collectives,
            check_replicated=check_replicated,
            check_data=check_data,
            skip_buffers=tuple(skip_buffers or ()),
            collective_timeout_s=collective_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            poll_s=poll_s,
            grace_s=grace_s,
            handle_sigterm=handle_sigterm,
        )
        self.guard: SanityGuard | None = None
        self.batches = 0  # training batches run: the same count on every rank

    @classmethod
    def from_config(cls, config: SanityConfig) -> ShardLabSanity:
        callback = cls()
        callback.config = config
        return callback

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = sharded_model_of(trainer, required_by="ShardLabSanity")
        self.guard = SanityGuard(sharded, trainer.optimizers, self.config).start()
        self.batches = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.guard is not None
        self.guard.install_sigterm()  # after Lightning registered its handlers (it does so after on_fit_start)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.guard is not None
        self.guard.before_step(self.batches, batch, trainer.train_dataloader)  # its sampler judges equal batches

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.guard is not None
        stop = self.guard.stop_after(self.batches)
        self.batches += 1
        if stop:
            raise SIGTERMException  # what Lightning itself raises on SIGTERM, here on every rank at the same step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.guard is not None:
            self.guard.finish()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.handle_exception(exception)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.guard is not None:
            self.guard.close()
