"""What a run on ranks started by spawn or fork leaves in the process that started them (a notebook's kernel).

The ranks' trainer and module are copies (pickled, or forked): what they learn stays in them unless it is sent
back. Lightning's multiprocessing launcher sends rank 0's metrics, the checkpoint callback's best path, the
trainer's state and the module's ``state_dict()``; here a rank's ``state_dict()`` is its shards, so every rank
joins ``full_state_dict()`` (the whole weights on rank 0) instead, and the checkpoint callbacks' scores and the
early-stopping callbacks' state come back as well, and what rank 0's budget and vitals wrote (the budget's
reports, the dashboard's files): ``trainer.checkpoint_callback.best_model_score``, ``early_stopping.stopped_epoch``,
``budget.reports``, ``vitals.paths`` and ``model.generate(...)`` read in the next cell what they read after a
script's fit. The loops' counters (``trainer.global_step``) stay in the ranks, as under ``ddp_spawn``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_shardlab.budget.callback import ShardLabBudget
from lightning_shardlab.sharding.materialize import has_meta
from lightning_shardlab.vitals.callback import ShardLabVitals

# what a ModelCheckpoint learns in fit (its state_dict's keys; its load_state_dict keeps most of them only if the
# directory it resolved in the ranks is the one it has here, which is unset until a fit runs here)
CHECKPOINT_KEYS = (
    "best_model_path",
    "best_model_score",
    "best_k_models",
    "kth_best_model_path",
    "kth_value",
    "last_model_path",
    "current_score",
    "dirpath",
)

# what rank 0's own callbacks hold after fit and a notebook shows next (plain data: sent pickled)
RANK_ZERO_FACTS = ((ShardLabBudget, "reports"), (ShardLabVitals, "paths"))


def callback_states(trainer: Trainer) -> bytes:
    """Rank 0: the checkpoint and early-stopping callbacks' state, as bytes (tensors sent as bytes, as Lightning
    sends the metrics, so no shared memory outlives the rank)."""
    states = {
        "checkpoints": [{k: getattr(c, k) for k in CHECKPOINT_KEYS} for c in _of(trainer, ModelCheckpoint)],
        "early_stopping": [c.state_dict() for c in _of(trainer, EarlyStopping)],
    }
    buffer = io.BytesIO()
    torch.save(states, buffer)
    facts = [[getattr(c, name, None) for c in _of(trainer, cls)] for cls, name in RANK_ZERO_FACTS]
    return pickle.dumps((buffer.getvalue(), facts))


def restore_callback_states(trainer: Trainer, blob: bytes) -> None:
    """This process: each checkpoint and early-stopping callback takes the state of its copy in the ranks (the
    n-th callback of a class, in the trainer's order; the strategy adds none of these classes)."""
    tensors, facts = pickle.loads(blob)  # from rank 0 of this run: a process this one started
    states = torch.load(io.BytesIO(tensors), weights_only=True)
    for callback, state in zip(_of(trainer, ModelCheckpoint), states["checkpoints"]):
        for key, value in state.items():
            setattr(callback, key, value)
    for callback, state in zip(_of(trainer, EarlyStopping), states["early_stopping"]):
        callback.load_state_dict(state)
    for (cls, name), values in zip(RANK_ZERO_FACTS, facts):
        for callback, value in zip(_of(trainer, cls), values):
            if value is not None:
                setattr(callback, name, value)


def _of(trainer: Trainer, cls: type) -> list[Any]:
    return [c for c in trainer.callbacks if isinstance(c, cls)]


def save_whole_weights(state: dict[str, Any]) -> str:
    """Rank 0: the whole ``state_dict`` into a file of a new temporary directory (the ranks may share no memory
    with this process); its path goes back to the main process, which removes the directory."""
    path = os.path.join(tempfile.mkdtemp(prefix="shardlab-weights-"), "weights.pt")
    torch.save(state, path)
    return path


def load_whole_weights(module: LightningModule, path: str) -> None:
    """This process: the module takes the whole weights the ranks trained. A module whose ``configure_model``
    built layers in the ranks builds them here on the meta device first, and every tensor still on the meta
    device takes the loaded tensor itself (``assign``): no memory is spent on an initialisation overwritten next."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    missing = set(state) - set(module.state_dict())
    if missing and is_overridden("configure_model", module, LightningModule):
        with torch.device("meta"):
            module.configure_model()
    result = module.load_state_dict(state, strict=False, assign=has_meta(module))
    if result.missing_keys or result.unexpected_keys:
        rank_zero_warn(
            f"The module in this process differs from the one the ranks trained: {len(result.missing_keys)}"
            f" entries kept their own values ({', '.join(result.missing_keys[:3])}...),"
            f" {len(result.unexpected_keys)} trained ones have no place here"
            f" ({', '.join(result.unexpected_keys[:3])}...). HINT: build every layer in __init__ or in an idempotent"
            " configure_model, so that both processes hold the same module."
        )
