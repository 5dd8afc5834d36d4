"""What the strategy calls to save, load and remove checkpoints, by format (the formats: __init__.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch.optim import Optimizer

from lightning_shardlab.checkpoint import dcp_load, dcp_read, dcp_save, residuals, sharded_load, sharded_save
from lightning_shardlab.checkpoint.async_save import AsyncSaver
from lightning_shardlab.checkpoint.atomic import (
    CheckpointError,
    clear_leftovers,
    commit,
    delete,
    fsync_file,
    new_id,
    remove_path,
    same_destination,
    tmp_path,
)
from lightning_shardlab.checkpoint.fabric_state import weights_of
from lightning_shardlab.checkpoint.format import EMA_RECORD, EMA_STATE_DICT, RANK_STATES_KEY, shards_of
from lightning_shardlab.checkpoint.full import (
    full_optimizer_state,
    full_state_dict,
    load_full_averages,
    load_full_optimizer_state,
    load_full_state_dict,
    replicated_state,
)
from lightning_shardlab.checkpoint.rank_state import (
    Owners,
    SavedRankStates,
    differing_paths,
    get_or_absent,
    restore,
    tree_digests,
)
from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.sharded_model import ShardedModel

__all__ = [
    "CheckpointError",
    "full_optimizer_state",
    "full_state_dict",
    "load",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "load_model",
    "load_optimizers",
    "module_state",
    "optimizer_state",
    "remove",
    "save",
]

SOURCE_KEY = "shardlab_checkpoint"  # in a loaded sharded checkpoint dict: its open CheckpointReader


def _remote(path: str | Path) -> bool:
    return "://" in str(path)


# ---- what Lightning's dump holds ----


def _current(sharded: ShardedModel) -> None:
    """Before a save or a load: values that user code gave a parameter as new ``.data`` are in the shards, and
    every parameter is named as the module registers it now (sharding/sharded_model.py)."""
    sharded.adopt_replaced()
    sharded.sync_names()


def module_state(sharded: ShardedModel) -> dict[str, Any]:
    """Collective for "full" (the unsharded state dict on rank 0); for "sharded", this rank's replicated
    entries (buffers): the parameters are written from the master shards by ``save``."""
    _current(sharded)
    return full_state_dict(sharded) if sharded.config.state_dict_type == "full" else replicated_state(sharded)


def optimizer_state(optimizer: Optimizer, sharded: ShardedModel) -> dict[str, Any]:
    """Collective for "full" (the unsharded torch format on rank 0); for "sharded", this rank's own state."""
    if sharded.config.state_dict_type == "full":
        return full_optimizer_state(optimizer, sharded)
    return optimizer.state_dict()


# ---- save ----


def save(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    precision: str,
    plugin: CheckpointIO,
    storage_options: Any = None,
    reshape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    saver: AsyncSaver | None = None,
) -> None:
    """Collective: write Lightning's dump (from ``module_state`` / ``optimizer_state``) atomically; a full file
    is written as ``reshape`` makes it (Fabric: the user's keys)."""
    _current(sharded)
    if sharded.config.state_dict_type == "dcp":  # int8 residuals are not kept: they restart at zero on load
        _save_dcp(checkpoint, filepath, sharded, optimizers, storage_options, saver)
        return
    residuals.stow(checkpoint, sharded)
    if sharded.averages is not None:
        checkpoint[EMA_RECORD] = sharded.averages.record()
    if sharded.config.state_dict_type == "full":
        _save_full(checkpoint, filepath, sharded, plugin, storage_options, reshape or (lambda c: c))
        return
    if storage_options is not None or _remote(filepath):
        raise TypeError(
            f"a sharded checkpoint is a file and a directory on a local or shared file system; got {filepath!r} with"
            f" storage_options={storage_options!r}. HINT: use a file system path, or state_dict_type='full' to"
            " write one file through the CheckpointIO plugin."
        )
    sharded_save.save_sharded(checkpoint, filepath, sharded, optimizers, precision, saver, reshape)


def _save_dcp(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    storage_options: Any,
    saver: AsyncSaver | None,
) -> None:
    """A torch Distributed Checkpoint directory (checkpoint/dcp_save.py), written synchronously."""
    if storage_options is not None or _remote(filepath) or saver is not None:
        raise TypeError(
            f"[rank {sharded.comm.rank}] state_dict_type='dcp' writes a directory on a local or shared file system,"
            f" synchronously; got {filepath!r} with storage_options={storage_options!r}"
            f"{', and a background saver (async_save or AsyncCheckpointIO)' if saver is not None else ''}. HINT: use a"
            " file system path and no CheckpointIO plugin, or state_dict_type='sharded' for background saves."
        )
    dcp_save.save_dcp(checkpoint, filepath, sharded, optimizers)


def _save_full(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    sharded: ShardedModel,
    plugin: CheckpointIO,
    storage_options: Any,
    reshape: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """1. agree on the destination and on the per-rank entries (their values travel to rank 0)
    2. rank 0 writes the file under a temporary name and renames it  3. every rank learns the outcome."""
    comm = sharded.comm
    final = str(filepath) if _remote(filepath) else Path(filepath).absolute()
    comparable = {**checkpoint, "state_dict": replicated_state(sharded)}
    mine = {"path": str(final), "tmp_id": new_id(), "digests": tree_digests(comparable)}
    everyone = collectives.all_gather_object(mine, comm, label="checkpoint plan")
    same_destination([e["path"] for e in everyone], "save")
    paths = differing_paths([e["digests"] for e in everyone])
    if paths:
        values = collectives.all_gather_object(
            [get_or_absent(comparable, p) for p in paths], comm, label="checkpoint rank states"
        )
        states = SavedRankStates(comm.world_size, paths, values, sharded.config.broadcast_buffers)
        checkpoint[RANK_STATES_KEY] = states.to_dict()
    if sharded.averages is not None:
        checkpoint[EMA_STATE_DICT] = full_state_dict(sharded, ema=True)  # collective; {} off rank 0
    outcome = None
    if comm.rank == 0:
        outcome = _write_full(reshape(checkpoint), final, everyone[0]["tmp_id"], plugin, storage_options)
    outcome = collectives.broadcast_object(outcome, comm)
    if outcome is not None:
        raise CheckpointError(outcome)


def _write_full(
    checkpoint: dict[str, Any], final: str | Path, tmp_id: str, plugin: CheckpointIO, storage_options: Any
) -> str | None:
    if isinstance(final, str):  # a remote URL: the plugin writes it (atomic only as far as the store is)
        plugin.save_checkpoint(checkpoint, final, storage_options=storage_options)
        return None
    tmp = tmp_path(final, tmp_id)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        replaced = None if final.is_symlink() else shards_of(final)  # a sharded checkpoint's shards, if one is there
        clear_leftovers(final, keep=frozenset(p for p in (tmp, replaced) if p is not None))
        plugin.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        fsync_file(tmp)
        commit(tmp, final)
        clear_leftovers(final)
        return None
    except Exception as err:  # noqa: BLE001  (every rank raises it)
        delete(tmp)
        return (
            f"saving the checkpoint {final} failed, so it was not written (any previous checkpoint of that name is"
            f" unchanged): {type(err).__name__}: {err}. HINT: check free space and permissions of {final.parent}."
        )


# ---- load ----


def load(
    filepath: str | Path, sharded: ShardedModel, owners: Owners, weights_only: bool | None, plugin: CheckpointIO
) -> dict[str, Any]:
    """Collective: open either format (or, with ``state_dict_type="dcp"``, a DCP directory), verify it, agree on
    the verdict, restore per-rank entries.

    The returned dict is what Lightning restores from; for a sharded checkpoint its ``state_dict`` holds
    the replicated entries and ``SOURCE_KEY`` the reader that ``load_model`` / ``load_optimizers`` use."""
    comm = sharded.comm
    _current(sharded)
    checkpoint, error = {}, None
    try:
        if not _remote(filepath) and dcp_read.is_dcp(filepath):  # by its file names: nothing opened unless asked
            if sharded.config.state_dict_type != "dcp":
                raise CheckpointError(dcp_read.not_asked(filepath))
            reader, checkpoint = dcp_load.open_checkpoint(Path(filepath), weights_only)
            checkpoint[SOURCE_KEY] = reader
        elif _remote(filepath) or (Path(filepath).is_file() and shards_of(filepath) is None):
            checkpoint = _load_full(filepath, plugin, weights_only)
        else:  # a model file and its shards, or a shard directory
            reader, checkpoint = sharded_load.open_verified(Path(filepath), sharded, weights_only)
            checkpoint[SOURCE_KEY] = reader
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001  (one rank's surprise must not leave the others waiting)
        error = f"loading the checkpoint {filepath} failed: {type(err).__name__}: {err}"
    where = str(filepath) if _remote(filepath) else str(Path(filepath).absolute())
    verdicts = collectives.all_gather_object((where, error), comm, label="checkpoint verification")
    same_destination([p for p, _ in verdicts], "load")
    bad = [(rank, e) for rank, (_, e) in enumerate(verdicts) if e is not None]
    if bad:
        rank, message = bad[0]
        others = f" and {len(bad) - 1} other rank(s)" if len(bad) > 1 else ""
        raise CheckpointError(f"{message} [found by rank {rank}{others}]")
    saved = checkpoint.pop(RANK_STATES_KEY, None)
    if saved and saved["paths"]:
        restore(checkpoint, SavedRankStates.from_dict(saved), comm.world_size, comm.rank, owners, str(filepath))
    return checkpoint


def _load_full(filepath: str | Path, plugin: CheckpointIO, weights_only: bool | None) -> dict[str, Any]:
    """Every rank reads the file; memory-mapped where it can be, so N ranks on one host share its pages and
    each touches one flat parameter at a time (load_full_state_dict) rather than holding a copy of all."""
    try:
        if type(plugin) is TorchCheckpointIO and not _remote(filepath):
            try:
                return torch.load(filepath, map_location="cpu", mmap=True, weights_only=weights_only)
            except RuntimeError as err:
                if "mmap" not in str(err):  # only files of torch's legacy format cannot be mapped
                    raise
        return plugin.load_checkpoint(filepath, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(
            f"checkpoint file {filepath} cannot be loaded ({type(err).__name__}: {err}). HINT: it may be truncated or"
            " damaged (a full checkpoint written by shardlab is renamed into place only once complete); if it holds"
            " your own classes and you trust it, pass weights_only=False."
        ) from None


def load_model(sharded: ShardedModel, checkpoint: Mapping[str, Any], strict: bool) -> None:
    """Collective: this rank's shard of every parameter, and the replicated entries; and of the averages,
    while ShardLabEMA keeps them."""
    reader = checkpoint.get(SOURCE_KEY)
    if isinstance(reader, dcp_read.DcpReader):
        dcp_load.load_model(sharded, reader, strict)
    elif reader is None:
        load_full_state_dict(sharded, checkpoint["state_dict"], strict=strict)
    else:
        sharded_load.load_model(sharded, reader, checkpoint["state_dict"], strict)
    residuals.restore(sharded, checkpoint)
    if sharded.averages is not None:
        _load_averages(sharded, checkpoint, reader)


def _load_averages(sharded: ShardedModel, checkpoint: Mapping[str, Any], reader: Any) -> None:
    """The saved average, resharded like the masters; a checkpoint without one restarts it from the weights."""
    record = checkpoint.get(EMA_RECORD)
    if record is not None and reader is not None:
        loaded = sharded_load.load_averages(sharded, reader)
    else:
        loaded = record is not None and load_full_averages(sharded, checkpoint.get(EMA_STATE_DICT, {}))
    if loaded:
        sharded.averages.load_record(record)
        return
    if sharded.comm.rank == 0:
        warnings.warn(
            "the checkpoint holds no weight average (it was saved without ShardLabEMA): the average"
            " starts again from the loaded weights.",
            stacklevel=3,
        )
    sharded.averages.restart(sharded)


def load_weights(
    filepath: str | Path,
    sharded: ShardedModel,
    owners: Owners,
    weights_only: bool | None,
    plugin: CheckpointIO,
    strict: bool,
) -> None:
    """Collective: only the module's weights, from a checkpoint of either front door (either format) or a plain
    state dict file: ``fabric.load_raw(path, model)`` and the Trainer strategy's ``load_raw(path)``."""
    checkpoint = weights_of(load(filepath, sharded, owners, weights_only, plugin), SOURCE_KEY)
    load_model(sharded, checkpoint, strict)


def load_optimizers(optimizers: list[Optimizer], sharded: ShardedModel, checkpoint: Mapping[str, Any]) -> None:
    reader = checkpoint.get(SOURCE_KEY)
    if isinstance(reader, dcp_read.DcpReader):
        dcp_load.load_optimizers(optimizers, sharded, reader)
    elif reader is None:
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            load_full_optimizer_state(optimizer, sharded, state)
    else:
        sharded_load.load_optimizers(optimizers, sharded, reader, checkpoint["optimizer_states"])
    if sharded.offload is not None:  # the loaded state goes where the run keeps it (offload/)
        for optimizer in optimizers:
            sharded.offload.settle_all(getattr(optimizer, "_optimizer", optimizer))


def remove(filepath: str | Path, plugin: CheckpointIO) -> None:
    """Rank 0: remove a checkpoint of either format: a full file; a sharded one's model file, then its shards (a
    directory is renamed aside first, then deleted); a link (``save_last="link"``), not what it links to."""
    if _remote(filepath):
        plugin.remove_checkpoint(filepath)
        return
    path = Path(filepath)
    shards = None if path.is_symlink() else shards_of(path)
    remove_path(path)
    if shards is not None:
        remove_path(shards)
