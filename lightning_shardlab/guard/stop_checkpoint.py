"""``CheckpointOnStop``: a complete checkpoint when the run stops in order (SIGTERM), nothing on a crash.

A preempted job gets SIGTERM; with ``handle_sigterm`` (orderly_stop.py) every rank stops after the same step and
Lightning raises ``SIGTERMException`` on each, so every rank is at the same point with every collective done: the
moment for a checkpoint the requeued job resumes from. Lightning's ``OnExceptionCheckpoint`` saves on any
exception; after a crash that is the wrong thing to do here: the survivors cannot write a sharded checkpoint
without the rank that died (the save would fail, and wait for it first), and a checkpoint taken mid-epoch resumes
Lightning's loop less exactly than the last one taken at an epoch's end. So this one saves on the orderly stop only.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException


class CheckpointOnStop(OnExceptionCheckpoint):
    """``CheckpointOnStop(dirpath="ckpts", filename="last")``: on SIGTERM, ``ckpts/last.ckpt`` is written (complete,
    on every rank together) before the run ends, so ``trainer.fit(..., ckpt_path="last")`` resumes from it."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            super().on_exception(trainer, pl_module, exception)
