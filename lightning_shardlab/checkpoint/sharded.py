"""Saving and loading sharded checkpoints (the format: [Note: the sharded checkpoint format] in
checkpoint/format.py). Collective: every rank calls, writes only its own slices and reads only the
slices of its new shard.

Save, every rank::

    1. agree (one all-gather): destination, temporary directory, optimizer state keys, per-rank entries
    2. write shard-r-of-N.pt (and rank-state-r-of-N.pt) into <name>.tmp-<id>; report size and sha256
    3. agree (one all-gather) that every rank's files are written
    4. rank 0: trainer_state.pt, metadata.json, COMPLETE (last), then move the directory into place
    5. agree (one broadcast) on rank 0's outcome: every rank returns, or every rank raises

A rank that dies in 2 never reaches 3, so no COMPLETE marker is ever written and the previous
checkpoint of that name stays in place. Load, every rank: open and verify what it will read, agree on
the verdict (one all-gather), then read its slices and re-gather the compute copies (stages 1-2).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.checkpoint.files import (
    CheckpointError,
    clear_leftovers,
    commit,
    delete,
    fsync_dir,
    new_id,
    tmp_path,
    write_json,
    write_torch,
)
from lightning_shardlab.checkpoint.format import (
    COMPLETE,
    EMA,
    FORMAT,
    METADATA,
    RANK_STATES_KEY,
    TRAINER_STATE,
    VERSION,
    CheckpointReader,
    dtype_name,
    layout_record,
    master_key,
    optim_key,
    rank_state_file,
    saved_range,
    shard_file,
)
from lightning_shardlab.checkpoint.full import optimizer_index, param_names
from lightning_shardlab.checkpoint.rank_state import KeyPath, differing_paths, get_or_absent, show, tree_digests
from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_per_element
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel

# ---- save ----


def _optimizer_summary(state: Mapping[str, Any], index: list[tuple[Tensor, FlatParam, int]]) -> dict[str, Any]:
    """This rank's optimizer state split into per-element keys (with dtypes) and scalar values, by index."""
    per_element: dict[int, dict[str, str]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for j, entries in state["state"].items():
        view = index[j][0]
        for key, value in entries.items():
            if is_per_element(key, value, view.shape):
                per_element.setdefault(j, {})[key] = dtype_name(value.dtype)
            else:
                scalars.setdefault(j, {})[key] = value
    return {"per_element": per_element, "scalars": scalars}


def _agree_optimizers(everyone: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Per optimizer: the union of per-element keys, and each scalar from the first rank that has it."""
    agreed = []
    for o in range(count):
        per_element: dict[int, dict[str, str]] = {}
        scalars: dict[int, dict[str, Any]] = {}
        for mine in everyone:
            for j, keys in mine["optim"][o]["per_element"].items():
                for key, dtype in keys.items():
                    per_element.setdefault(j, {}).setdefault(key, dtype)
            for j, values in mine["optim"][o]["scalars"].items():
                for key, value in values.items():
                    scalars.setdefault(j, {}).setdefault(key, value)
        agreed.append({"per_element": per_element, "scalars": scalars})
    return agreed


def _shard_tensors(
    sharded: ShardedModel, optimizers: list[Optimizer], states: list[Mapping[str, Any]], agreed: list[dict[str, Any]]
) -> tuple[dict[str, Tensor], list[dict[str, str]]]:
    """This rank's shard file content, and per flat parameter the tensor kinds every shard file holds."""
    tensors: dict[str, Tensor] = {}
    kinds: list[dict[str, str]] = []
    fps = sharded.flat_params
    averaged = sharded.averages.shards if sharded.averages is not None else [None] * len(fps)
    for fp, avg in zip(fps, averaged):
        lo, hi = saved_range(fp.layout, fp.rank)
        tensors[master_key(fp.layout.name)] = _saved(fp.master, hi - lo)
        kinds.append({"master": dtype_name(fp.master.dtype)})
        if avg is not None:  # ShardLabEMA's average of this shard
            tensors[f"{EMA}/{fp.layout.name}"] = _saved(avg, hi - lo)
            kinds[-1][EMA] = dtype_name(avg.dtype)
    for o, (optimizer, state, plan) in enumerate(zip(optimizers, states, agreed)):
        index = optimizer_index(optimizer, sharded)
        keys_per_fp: dict[int, dict[str, str]] = {}
        members: dict[int, list[int]] = {}  # id(flat param) -> its parameter indices in this optimizer
        for j, (_, owner, _) in enumerate(index):
            members.setdefault(id(owner), []).append(j)
        for j, keys in plan["per_element"].items():
            keys_per_fp.setdefault(id(index[j][1]), {}).update(keys)
        for f, fp in enumerate(fps):
            lo, hi = saved_range(fp.layout, fp.rank)
            for key, dtype in sorted(keys_per_fp.get(id(fp), {}).items()):
                values = [(j, state["state"].get(j, {}).get(key)) for j in members[id(fp)]]
                flat = _state_from_file(sharded, optimizer, fp, key, [v for _, v in values], hi - lo)
                if flat is None:
                    flat = torch.zeros(hi - lo, dtype=getattr(torch, dtype))  # 1-D, this rank's unpadded elements
                    for j, value in values:
                        if value is not None:
                            a, b = fp.layout.slot_in_shard(fp.layout.slots[index[j][2]], fp.rank)
                            flat[a:b] = value.detach().reshape(-1).to("cpu")
                tensors[optim_key(o, key, fp.layout.name)] = flat
                kinds[f][f"optim{o}/{key}"] = dtype
    return tensors, kinds


def _saved(tensor: Tensor, n: int) -> Tensor:
    """What a shard file holds of ``tensor`` (1-D): its first ``n`` elements. A CPU tensor that is its storage's
    only content (a stage 3 shard, a master of its own, an offload file) is written from where it lies, not
    copied first (``torch.save`` writes a view's whole storage: the padding's few elements come along);
    anything else (a view of a resident full buffer, a device tensor) is copied out."""
    alone = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor[:n].detach() if tensor.device.type == "cpu" and alone else tensor[:n].detach().to("cpu", copy=True)


def _state_from_file(
    sharded: ShardedModel, optimizer: Optimizer, fp: FlatParam, key: str, values: list[Tensor | None], n: int
) -> Tensor | None:
    """The offload file of ``optimizer``'s state ``key`` for ``fp`` when every parameter's value is a view of it
    (or empty: a parameter outside this shard), written from the file's pages; else None (copied out)."""
    offload = sharded.offload
    file = offload.state_file(optimizer, fp, key) if offload is not None and offload.tier == "disk" else None
    if file is None:
        return None
    ptr = file.untyped_storage().data_ptr()
    inside = all(v is not None and (v.numel() == 0 or v.untyped_storage().data_ptr() == ptr) for v in values)
    return file[:n] if inside else None


def save_sharded(
    checkpoint: dict[str, Any], filepath: str | Path, sharded: ShardedModel, optimizers: list[Optimizer], precision: str
) -> None:
    """Collective: write ``checkpoint`` (Lightning's dump, with this rank's local optimizer state dicts and
    the module's replicated entries) as a sharded checkpoint directory, atomically."""
    comm = sharded.comm
    final = Path(filepath).absolute()
    states = checkpoint.get("optimizer_states", [])
    indexes = [optimizer_index(opt, sharded) for opt in optimizers[: len(states)]]
    mine = {
        "path": str(final),
        "tmp_id": new_id(),
        "digests": tree_digests(checkpoint),
        "optim": [_optimizer_summary(s, i) for s, i in zip(states, indexes)],
    }
    everyone = collectives.all_gather_object(mine, comm, label="checkpoint plan")  # 1.
    same_destination([e["path"] for e in everyone], "save")
    tmp = tmp_path(final, everyone[0]["tmp_id"])
    agreed = _agree_optimizers(everyone, len(states))
    rank_paths = differing_paths([e["digests"] for e in everyone])
    written = _write_rank_files(tmp, checkpoint, sharded, optimizers, agreed, rank_paths)  # 2.
    reports = collectives.all_gather_object(written, comm, label="checkpoint files")  # 3.
    outcome = None
    if comm.rank == 0:  # 4.
        outcome = _finish(tmp, final, checkpoint, sharded, indexes, agreed, rank_paths, reports, precision)
    outcome = collectives.broadcast_object(outcome, comm)  # 5.
    if outcome is not None:
        raise CheckpointError(outcome)


def same_destination(paths: list[str], action: str) -> None:
    if len(set(paths)) > 1:
        raise ValueError(
            f"ranks were asked to {action} different checkpoints: {sorted(set(paths))}. HINT: pass the"
            " same path on every rank (e.g. compute it on rank 0 and broadcast it)."
        )


def _write_rank_files(
    tmp: Path,
    checkpoint: dict[str, Any],
    sharded: ShardedModel,
    optimizers: list[Optimizer],
    agreed: list[dict[str, Any]],
    rank_paths: list[KeyPath],
) -> dict[str, Any]:
    """2. This rank's files; ``{"files": {name: record}, "kinds": ...}`` or ``{"error": message}``. With
    hybrid sharding the shard groups hold equal shards: the first group writes them, each shard once."""
    comm, shard = sharded.comm, sharded.mesh.shard
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        states = checkpoint.get("optimizer_states", [])
        tensors, kinds = _shard_tensors(sharded, optimizers, states, agreed)
        files = {}
        if sharded.mesh.replica.rank == 0:
            name = shard_file(shard.rank, shard.world_size)
            files[name] = write_torch(tensors, tmp / name)
        if rank_paths:
            values = [get_or_absent(checkpoint, p) for p in rank_paths]
            name = rank_state_file(comm.rank, comm.world_size)
            files[name] = write_torch({"values": values}, tmp / name)
        return {"files": files, "kinds": kinds}
    except Exception as err:  # noqa: BLE001  (reported to every rank, which all raise)
        return {"error": f"rank {comm.rank} could not write its part of {tmp}: {type(err).__name__}: {err}"}


def _finish(
    tmp: Path,
    final: Path,
    checkpoint: dict[str, Any],
    sharded: ShardedModel,
    indexes: list[list[tuple[Tensor, FlatParam, int]]],
    agreed: list[dict[str, Any]],
    rank_paths: list[KeyPath],
    reports: list[dict[str, Any]],
    precision: str,
) -> str | None:
    """4. Rank 0: the shared files, the marker, the move into place. Returns an error message or None."""
    errors = [r["error"] for r in reports if "error" in r]
    try:
        if errors:
            raise CheckpointError("; ".join(errors))
        clear_leftovers(final, keep=tmp)
        files = {name: record for r in reports for name, record in r["files"].items()}
        trainer_state = dict(checkpoint)
        if "optimizer_states" in checkpoint:
            trainer_state["optimizer_states"] = [
                {"state": plan["scalars"], "param_groups": state["param_groups"]}
                for plan, state in zip(agreed, checkpoint["optimizer_states"])
            ]
        config = sharded.config
        trainer_state[RANK_STATES_KEY] = {
            "world_size": sharded.comm.world_size,
            "paths": [list(p) for p in rank_paths],
            "broadcast_buffers": config.broadcast_buffers,
        }
        files[TRAINER_STATE] = write_torch(trainer_state, tmp / TRAINER_STATE)
        meta = _metadata(sharded, indexes, agreed, rank_paths, reports[0]["kinds"], files, precision)
        record = write_json(meta, tmp / METADATA)
        write_json({"format": FORMAT, "version": VERSION, "metadata": record}, tmp / COMPLETE)
        fsync_dir(tmp)
        commit(tmp, final)
        return None
    except Exception as err:  # noqa: BLE001
        delete(tmp)
        return (
            f"saving the checkpoint {final} failed, so it was not written (any previous checkpoint of that name is"
            f" unchanged): {type(err).__name__}: {err}. HINT: check free space and permissions of {final.parent}."
        )


def _metadata(
    sharded: ShardedModel,
    indexes: list[list[tuple[Tensor, FlatParam, int]]],
    agreed: list[dict[str, Any]],
    rank_paths: list[KeyPath],
    kinds: list[dict[str, str]],
    files: dict[str, Any],
    precision: str,
) -> dict[str, Any]:
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
        "precision": precision,
        "broadcast_buffers": sharded.config.broadcast_buffers,
        "module": f"{module.__module__}.{module.__qualname__}",
        "state_dict_keys": keys,
        "flat_params": [layout_record(fp.layout, k) for fp, k in zip(sharded.flat_params, kinds)],
        "optimizers": [
            {
                "params": [fp.layout.slots[i].name for _, fp, i in index],
                "state_keys": [sorted(plan["per_element"].get(j, {})) for j in range(len(index))],
            }
            for index, plan in zip(indexes, agreed)
        ],
        "rank_state": {
            "paths": [show(p) for p in rank_paths],
            "files": [rank_state_file(r, world) for r in range(world)] if rank_paths else [],
        },
        "files": files,
    }


# ---- load ----


def needed_files(reader: CheckpointReader, sharded: ShardedModel) -> set[str]:
    """The files this rank reads: shared ones, and the shard files that overlap its new shards."""
    ranks: set[int] = set()
    for fp in sharded.flat_params:
        for slot, (a, b) in _overlaps(fp):
            name = next((f for f in slot.fqns if f in reader.where), None)
            if name is not None and reader.where[name][1].shape == slot.shape:  # else load_model refuses it
                ranks |= reader.ranks_holding(name, a, b)
    files = {TRAINER_STATE, *reader.rank_state_files()}
    return files | {reader.shard_files()[r] for r in ranks}


def _overlaps(fp: FlatParam):  # noqa: ANN202
    """(slot, [a, b) in the parameter's own elements) for each parameter part in this rank's shard."""
    start = fp.layout.shard_range(fp.rank)[0]
    for slot in fp.layout.slots:
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
        if hi > lo:
            yield slot, (start + lo - slot.offset, start + hi - slot.offset)


def open_verified(path: Path, sharded: ShardedModel, weights_only: bool | None) -> tuple[CheckpointReader, dict]:
    """Not collective: open the checkpoint and verify what this rank will read. Raises ``CheckpointError``."""
    reader = CheckpointReader.open(path)
    reader.verify(needed_files(reader, sharded))
    checkpoint = reader.load_trainer_state(weights_only)
    saved = checkpoint.pop(RANK_STATES_KEY, None)
    if saved and saved["paths"]:
        values = [s["values"] for s in reader.load_rank_states(weights_only)]
        checkpoint[RANK_STATES_KEY] = {**saved, "values": values}
    return reader, checkpoint


def load_model(sharded: ShardedModel, reader: CheckpointReader, buffers: Mapping[str, Any], strict: bool) -> None:
    """Collective (stages 1-2 re-gather): every rank reads its master slices, then the replicated entries."""
    with placeholders_allowed():
        expected = set(sharded.module.state_dict(keep_vars=True))
    params = param_names(sharded)
    if strict:
        present = set(reader.where) | set(buffers)
        missing, unexpected = sorted(expected - present), sorted(present - expected)
        if missing or unexpected:
            raise KeyError(
                f"the checkpoint {reader.path} does not match {type(sharded.module).__name__}: missing {missing[:5]},"
                f" unexpected {unexpected[:5]}. HINT: load a checkpoint of the same model, or set strict_loading=False."
            )
    _check_shapes(sharded, reader)
    plan = []
    for fp in sharded.flat_params:
        for slot, (a, b) in _overlaps(fp):
            name = next((f for f in slot.fqns if f in reader.where), None)
            if name is not None:  # strict=False and absent: keep its current values
                plan.append((fp, fp.layout.slot_in_shard(slot, fp.rank), name, a, b))
    with torch.no_grad():
        for fp, (lo, hi), name, a, b in plan:
            fp.master[lo:hi].copy_(reader.read_param("master", name, a, b))
    sharded.refresh(set(sharded.flat_params))  # the compute copies: resident (stages 1-2) or gathered units
    sharded.module.load_state_dict({k: v for k, v in buffers.items() if k not in params}, strict=False)


def _check_shapes(sharded: ShardedModel, reader: CheckpointReader) -> None:
    """Every parameter's saved shape against the model's, in the same order on every rank (not only this
    rank's shard), so every rank refuses with the same message."""
    for fp in sharded.flat_params:
        for slot in fp.layout.slots:
            name = next((f for f in slot.fqns if f in reader.where), None)
            saved = reader.where[name][1].shape if name is not None else slot.shape
            if saved != slot.shape:
                raise ValueError(
                    f"{name!r} has shape {tuple(saved)} in the checkpoint {reader.path} but {tuple(slot.shape)} in"
                    " the model. HINT: load a checkpoint of the same model configuration."
                )


def load_averages(sharded: ShardedModel, reader: CheckpointReader) -> bool:
    """Every rank: its slices of the saved averages (ShardLabEMA), read like the masters; False (nothing
    loaded) when the checkpoint holds no average for one of them."""
    plan = []
    for fp, avg in zip(sharded.flat_params, sharded.averages.shards):
        for slot, (a, b) in _overlaps(fp) if avg is not None else ():
            name = next((f for f in slot.fqns if f in reader.where), None)
            if name is None or EMA not in reader.tensors[reader.where[name][0]]:
                return False
            plan.append((avg, fp.layout.slot_in_shard(slot, fp.rank), name, a, b))
    with torch.no_grad():
        for avg, (lo, hi), name, a, b in plan:
            avg[lo:hi].copy_(reader.read_param(EMA, name, a, b))
    return True


def load_optimizers(
    optimizers: list[Optimizer], sharded: ShardedModel, reader: CheckpointReader, skeletons: list[Mapping[str, Any]]
) -> None:
    """Every rank: rebuild each optimizer's local state from the saved slices that overlap its shards."""
    saved = reader.meta["optimizers"]
    if not (len(saved) == len(skeletons) == len(optimizers)):
        raise ValueError(
            f"the checkpoint {reader.path} holds {len(saved)} optimizer states but"
            f" configure_optimizers() made {len(optimizers)}. HINT: resume with the same"
            " configure_optimizers()."
        )
    indexes = [optimizer_index(optimizer, sharded) for optimizer in optimizers]
    for optimizer, index, skeleton, record in zip(optimizers, indexes, skeletons, saved):
        _check_same_params(optimizer, index, skeleton, record, reader)  # all of them before loading any
    for o, (optimizer, index, skeleton, record) in enumerate(zip(optimizers, indexes, skeletons, saved)):
        state: dict[int, dict[str, Any]] = {
            int(j): {k: v.clone() if isinstance(v, Tensor) else v for k, v in scalars.items()}
            for j, scalars in skeleton["state"].items()
        }
        for j, keys in enumerate(record["state_keys"]):
            _, fp, slot_i = index[j]
            slot = fp.layout.slots[slot_i]
            lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
            a = fp.layout.shard_range(fp.rank)[0] + lo - slot.offset
            for key in keys:
                state.setdefault(j, {})[key] = reader.read_param(f"optim{o}/{key}", record["params"][j], a, a + hi - lo)
        optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def _check_same_params(
    optimizer: Optimizer,
    index: list[tuple[Tensor, FlatParam, int]],
    skeleton: Mapping[str, Any],
    record: Mapping[str, Any],
    reader: CheckpointReader,
) -> None:
    sizes = [len(g["params"]) for g in skeleton["param_groups"]]
    if sizes != [len(g["params"]) for g in optimizer.param_groups] or len(record["params"]) != len(index):
        raise ValueError(
            f"the optimizer state in {reader.path} has param groups of sizes {sizes} but"
            f" {type(optimizer).__name__} has {[len(g['params']) for g in optimizer.param_groups]}."
            " HINT: resume with the same configure_optimizers()."
        )
    for j, ((_, fp, slot_i), name) in enumerate(zip(index, record["params"])):
        if name not in fp.layout.slots[slot_i].fqns:
            raise ValueError(
                f"parameter {j} of {type(optimizer).__name__} is {fp.layout.slots[slot_i].name!r}, but {name!r} in the"
                f" checkpoint {reader.path}. HINT: build the optimizer's param groups in the same order as when saving."
            )
