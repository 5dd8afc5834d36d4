"""Saving a sharded checkpoint (the format: [Note: the sharded checkpoint format] in checkpoint/format.py).
Collective: every rank calls and writes only its own slices. Every rank::

    1. agree (one all-gather): destination, save id, optimizer state keys, per-rank entries; rank 0 writes the
       model file <name>.tmp-<id> with a hole for every parameter, and every rank learns where its slices go
       (one broadcast: checkpoint/model_file.py)
    2. write shard-r-of-N.pt (and rank-state-r-of-N.pt) into the shard directory <name>.shards-<id>, and this
       rank's slices of the parameters into the model file; report sizes and sha256
       (``async_save``: on a background thread, from copies; 3-5 run when the next save, a load or the end
       of fit waits for it: checkpoint/async_save.py)
    3. agree (one all-gather) that every rank's files are written
    4. rank 0: trainer_state.pt, metadata.json, COMPLETE (last) in the shard directory, then move the model
       file into place (the commit), then delete the shards of the checkpoint it replaced
    5. agree (one broadcast) on rank 0's outcome: every rank returns, or every rank raises

A rank that dies in 2 never reaches 3, so no COMPLETE marker is ever written, no model file moves into place,
and the previous checkpoint of that name (its file and the shards it names) stays. Loading is
checkpoint/sharded_load.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from copy import deepcopy as copy_of
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.checkpoint import model_file, owned_state
from lightning_shardlab.checkpoint.async_save import AsyncSaver
from lightning_shardlab.checkpoint.atomic import (
    CheckpointError,
    clear_leftovers,
    commit,
    delete,
    fsync_dir,
    fsync_file,
    new_id,
    same_destination,
    tmp_path,
    write_json,
    write_torch,
)
from lightning_shardlab.checkpoint.format import (
    COMPLETE,
    FORMAT,
    METADATA,
    RANK_STATES_KEY,
    TRAINER_STATE,
    VERSION,
    dtype_name,
    layout_record,
    owned_file,
    rank_state_file,
    shard_file,
    shards_of,
)
from lightning_shardlab.checkpoint.full import optimizer_index
from lightning_shardlab.checkpoint.rank_state import KeyPath, differing_paths, get_or_absent, show, tree_digests
from lightning_shardlab.checkpoint.shard_tensors import shard_tensors
from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_per_element, is_whole_tensor
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel


def _optimizer_summary(
    optimizer: Optimizer, state: Mapping[str, Any], index: list[tuple[Tensor, FlatParam, int]]
) -> dict[str, Any]:
    """This rank's optimizer state split into per-element keys (with dtypes), scalar values, and (a whole-tensor
    optimizer) the tensors it holds whole as the owner of their parameters, by index."""
    if is_whole_tensor(optimizer):
        owned, scalars = owned_state.summarize(state)
        return {"per_element": {}, "scalars": scalars, "owned": owned}
    per_element: dict[int, dict[str, str]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for j, entries in state["state"].items():
        view = index[j][0]
        for key, value in entries.items():
            if is_per_element(key, value, view.shape):
                per_element.setdefault(j, {})[key] = dtype_name(value.dtype)
            else:
                scalars.setdefault(j, {})[key] = value
    return {"per_element": per_element, "scalars": scalars, "owned": {}}


def _agree_optimizers(everyone: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Per optimizer: the union of per-element keys, each scalar from the first rank that has it, and where
    each owned parameter's state is."""
    agreed = []
    for o, count in enumerate(counts):
        per_element: dict[int, dict[str, str]] = {}
        scalars: dict[int, dict[str, Any]] = {}
        for mine in everyone:
            for j, keys in mine["optim"][o]["per_element"].items():
                for key, dtype in keys.items():
                    per_element.setdefault(j, {}).setdefault(key, dtype)
            for j, values in mine["optim"][o]["scalars"].items():
                for key, value in values.items():
                    scalars.setdefault(j, {}).setdefault(key, value)
        owned = owned_state.agree([mine["optim"][o]["owned"] for mine in everyone], count, len(everyone))
        agreed.append({"per_element": per_element, "scalars": scalars, "owned": owned})
    return agreed


def save_sharded(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    precision: str,
    saver: AsyncSaver | None = None,
    reshape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> None:
    """Collective: write ``checkpoint`` (Lightning's dump, with this rank's local optimizer state dicts and
    the module's replicated entries) as a sharded checkpoint (its model file, laid out as ``reshape`` makes it,
    and its shard directory), atomically. With ``saver`` (async): 1. runs now, 2. on the saver's thread from
    copies taken now, 3-5 when the saver next waits."""
    comm = sharded.comm
    final = Path(filepath).absolute()
    states = checkpoint.get("optimizer_states", [])
    indexes = [optimizer_index(opt, sharded) for opt in optimizers[: len(states)]]
    mine = {
        "path": str(final),
        "tmp_id": new_id(),
        "digests": tree_digests(checkpoint),
        "optim": [_optimizer_summary(o, s, i) for o, s, i in zip(optimizers, states, indexes)],
    }
    everyone = collectives.all_gather_object(mine, comm, label="checkpoint plan")  # 1.
    same_destination([e["path"] for e in everyone], "save")
    tmp = final.with_name(model_file.shards_name(final, everyone[0]["tmp_id"]))  # the shard directory
    model_tmp = tmp_path(final, everyone[0]["tmp_id"])  # the model file, until it is moved into place
    agreed = _agree_optimizers(everyone, [len(index) for index in indexes])
    rank_paths = differing_paths([e["digests"] for e in everyone])
    background = saver is not None
    try:
        contents = _rank_contents(checkpoint, sharded, optimizers, agreed, rank_paths, copy=background)
    except Exception as err:  # noqa: BLE001  (reported to every rank at 3., which all raise)
        contents = {"error": f"rank {comm.rank} could not take its part: {type(err).__name__}: {err}", "kinds": []}
    trainer_state = _trainer_state(checkpoint, sharded, agreed, rank_paths) if comm.rank == 0 else {}
    if background:
        trainer_state = copy_of(trainer_state)  # its tensors (buffers) go on changing
    offsets = _lay_out_model_file(model_tmp, final, checkpoint, sharded, tmp.name, reshape or (lambda c: c))
    plan = SavePlan(
        tmp, model_tmp, final, trainer_state, sharded, indexes, agreed, rank_paths, precision, contents["kinds"]
    )
    conclude = functools.partial(_conclude, plan)
    write = functools.partial(_write_rank_files, tmp, contents, sharded, model_tmp, offsets)
    if saver is None:
        conclude(write())
    else:
        saver.submit(write, conclude)


def _lay_out_model_file(
    path: Path,
    final: Path,
    checkpoint: dict[str, Any],
    sharded: ShardedModel,
    shards: str,
    reshape: Callable[[dict[str, Any]], dict[str, Any]],
) -> model_file.Offsets:
    """1. (end) Rank 0 writes the model file with its holes; every rank learns where its slices go, or raises
    rank 0's failure (one broadcast)."""
    outcome: dict[str, Any] = {}
    if sharded.comm.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            outcome["offsets"] = model_file.write_skeleton(path, checkpoint, sharded, shards, reshape)
        except Exception as err:  # noqa: BLE001  (every rank raises it)
            delete(path)
            outcome["error"] = (
                f"saving the checkpoint {final} failed, so it was not written (any previous checkpoint of that name"
                f" is unchanged): {type(err).__name__}: {err}. HINT: check free space and permissions of"
                f" {final.parent}."
            )
    outcome = collectives.broadcast_object(outcome, sharded.comm)
    if "error" in outcome:
        raise CheckpointError(outcome["error"])
    return outcome["offsets"]


@dataclass(frozen=True)
class SavePlan:
    """What the ranks agreed in 1. and what rank 0 needs for 4."""

    tmp: Path  # the shard directory
    model_tmp: Path  # the model file, before it is moved into place
    final: Path
    trainer_state: dict[str, Any]  # rank 0's trainer_state.pt ({} elsewhere)
    sharded: ShardedModel
    indexes: list[list[tuple[Tensor, FlatParam, int]]]
    agreed: list[dict[str, Any]]
    rank_paths: list[KeyPath]
    precision: str
    kinds: list[dict[str, str]]  # per flat parameter, the tensor kinds every shard file holds


def _conclude(plan: SavePlan, written: dict[str, Any]) -> None:
    """3.-5. Collective: every rank's files are written (or not): rank 0 finishes, every rank learns the outcome."""
    comm = plan.sharded.comm
    reports = collectives.all_gather_object(written, comm, label="checkpoint files")  # 3.
    outcome = None
    if comm.rank == 0:  # 4.
        outcome = _finish(plan, reports)
    outcome = collectives.broadcast_object(outcome, comm)  # 5.
    if outcome is not None:
        raise CheckpointError(outcome)


def _rank_contents(
    checkpoint: dict[str, Any],
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    agreed: list[dict[str, Any]],
    rank_paths: list[KeyPath],
    copy: bool,
) -> dict[str, Any]:
    """What this rank's files will hold: its shard tensors, and its values of the entries that differ by rank."""
    states = checkpoint.get("optimizer_states", [])
    tensors, kinds = shard_tensors(sharded, optimizers, states, agreed, copy)
    indexes = [optimizer_index(opt, sharded) for opt in optimizers[: len(states)]]
    owned = owned_state.owned_tensors(optimizers, states, indexes, copy)
    values = [get_or_absent(checkpoint, p) for p in rank_paths]
    return {"tensors": tensors, "kinds": kinds, "owned": owned, "values": copy_of(values) if copy else values}


def _write_rank_files(
    tmp: Path, contents: dict[str, Any], sharded: ShardedModel, model_tmp: Path, offsets: model_file.Offsets
) -> dict[str, Any]:
    """2. This rank's files, and its slices of the model file; ``{"files": {name: record}}`` or ``{"error":
    message}``. With hybrid sharding the shard groups hold equal shards: the first group writes them, once."""
    comm, shard = sharded.comm, sharded.mesh.shard
    if "error" in contents:
        return {"error": contents["error"]}
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        files = {}
        if sharded.mesh.replica.rank == 0:
            name = shard_file(shard.rank, shard.world_size)
            files[name] = write_torch(contents["tensors"], tmp / name)
        if contents["owned"]:  # a whole-tensor optimizer's state of the parameters this rank owns
            name = owned_file(comm.rank, comm.world_size)
            files[name] = write_torch(contents["owned"], tmp / name)
        if contents["values"]:
            name = rank_state_file(comm.rank, comm.world_size)
            files[name] = write_torch({"values": contents["values"]}, tmp / name)
        model_file.write_slices(model_tmp, offsets, contents["tensors"], sharded)
        return {"files": files}
    except Exception as err:  # noqa: BLE001  (reported to every rank, which all raise)
        return {"error": f"rank {comm.rank} could not write its part of {tmp}: {type(err).__name__}: {err}"}


def _trainer_state(
    checkpoint: dict[str, Any], sharded: ShardedModel, agreed: list[dict[str, Any]], rank_paths: list[KeyPath]
) -> dict[str, Any]:
    """Rank 0's trainer_state.pt: Lightning's dump without the sharded tensors (optimizer scalars kept)."""
    trainer_state = dict(checkpoint)
    if "optimizer_states" in checkpoint:
        trainer_state["optimizer_states"] = [
            {"state": plan["scalars"], "param_groups": state["param_groups"]}
            for plan, state in zip(agreed, checkpoint["optimizer_states"])
        ]
    trainer_state[RANK_STATES_KEY] = {
        "world_size": sharded.comm.world_size,
        "paths": [list(p) for p in rank_paths],
        "broadcast_buffers": sharded.config.broadcast_buffers,
    }
    return trainer_state


def _finish(plan: SavePlan, reports: list[dict[str, Any]]) -> str | None:
    """4. Rank 0: the shared files, the marker, the move into place. Returns an error message or None."""
    errors = [r["error"] for r in reports if "error" in r]
    tmp, final = plan.tmp, plan.final
    try:
        if errors:
            raise CheckpointError("; ".join(errors))
        replaced = shards_of(final) if not final.is_symlink() else None  # the shards of what is there now
        clear_leftovers(final, keep=frozenset(p for p in (tmp, plan.model_tmp, replaced) if p is not None))
        files = {name: record for r in reports for name, record in r["files"].items()}
        files[TRAINER_STATE] = write_torch(plan.trainer_state, tmp / TRAINER_STATE)
        meta = _metadata(plan, files)
        record = write_json(meta, tmp / METADATA)
        write_json({"format": FORMAT, "version": VERSION, "metadata": record}, tmp / COMPLETE)
        fsync_dir(tmp)
        fsync_file(plan.model_tmp)
        commit(plan.model_tmp, final)  # the commit point: the checkpoint is now the new one, whole
        clear_leftovers(final, keep=frozenset((tmp,)))  # the shards of the one it replaced
        return None
    except Exception as err:  # noqa: BLE001
        delete(plan.model_tmp)
        delete(tmp)
        return (
            f"saving the checkpoint {final} failed, so it was not written (any previous checkpoint of that name is"
            f" unchanged): {type(err).__name__}: {err}. HINT: check free space and permissions of {final.parent}."
        )


def _metadata(plan: SavePlan, files: dict[str, Any]) -> dict[str, Any]:
    sharded, indexes, agreed, kinds = plan.sharded, plan.indexes, plan.agreed, plan.kinds
    with placeholders_allowed():
        keys = list(sharded.module.state_dict(keep_vars=True))
    module = type(sharded.module)
    world = sharded.comm.world_size
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": sharded.mesh.shard.world_size,  # the shards' N: the shard group's size (hybrid), else the world
        "replicas": sharded.mesh.replica.world_size,  # shard groups that held the same shards (1: plain sharding)
        "stage": int(sharded.config.stage),
        "precision": plan.precision,
        "broadcast_buffers": sharded.config.broadcast_buffers,
        "module": f"{module.__module__}.{module.__qualname__}",
        "state_dict_keys": keys,
        "flat_params": [layout_record(fp.layout, k) for fp, k in zip(sharded.flat_params, kinds)],
        "optimizers": [
            {
                "params": [fp.layout.slots[i].name for _, fp, i in index],
                "state_keys": [sorted(keys["per_element"].get(j, {})) for j in range(len(index))],
                **({"owned": keys["owned"]} if any(keys["owned"]) else {}),
            }
            for index, keys in zip(indexes, agreed)
        ],
        "rank_state": {
            "paths": [show(p) for p in plan.rank_paths],
            "files": [rank_state_file(r, world) for r in range(world)] if plan.rank_paths else [],
        },
        "files": files,
    }
