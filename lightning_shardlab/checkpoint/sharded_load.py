"""Loading a sharded checkpoint at any world size and stage (the format: checkpoint/format.py). Collective:
every rank opens and verifies the files it will read (the shards overlapping its new shards), the ranks agree
on the verdict (one all-gather, in checkpoint/save_load.py), then each reads its slices and re-gathers the
compute copies (stages 1-2). Saving is checkpoint/sharded_save.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.checkpoint import owned_state
from lightning_shardlab.checkpoint.format import (
    EMA,
    RANK_STATES_KEY,
    TRAINER_STATE,
    CheckpointReader,
)
from lightning_shardlab.checkpoint.full import optimizer_index, param_names
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_whole_tensor
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel
from lightning_shardlab.sharding.whole_step import plan_of


def needed_files(reader: CheckpointReader, sharded: ShardedModel) -> set[str]:
    """The files this rank reads: shared ones, and the shard files that overlap its new shards."""
    ranks: set[int] = set()
    for fp in sharded.flat_params:
        for slot, (a, b) in _overlaps(fp):
            name = next((f for f in slot.fqns if f in reader.where), None)
            if name is not None and reader.where[name][1].shape == slot.shape:  # else load_model refuses it
                ranks |= reader.ranks_holding(name, a, b)
    files = {TRAINER_STATE, *reader.rank_state_files()}
    world = sharded.mesh.world
    owned = owned_state.new_owner_files(reader, world.world_size, world.rank)
    return files | owned | {reader.shard_files()[r] for r in ranks}


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
        if is_whole_tensor(optimizer):
            _read_owned(optimizer, sharded, reader, o, state)
        for j, keys in enumerate(record["state_keys"]):
            _, fp, slot_i = index[j]
            slot = fp.layout.slots[slot_i]
            lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
            a = fp.layout.shard_range(fp.rank)[0] + lo - slot.offset
            for key in keys:
                state.setdefault(j, {})[key] = reader.read_param(f"optim{o}/{key}", record["params"][j], a, a + hi - lo)
        optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def _read_owned(
    optimizer: Optimizer, sharded: ShardedModel, reader: CheckpointReader, o: int, state: dict[int, dict[str, Any]]
) -> None:
    """A whole-tensor optimizer: the saved state of the parameters this rank owns now, whole."""
    plan = plan_of(optimizer, sharded)
    for j, param in enumerate(plan.params):
        if plan.owns(param):
            state.setdefault(j, {}).update(owned_state.read_owned(reader, o, j))


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
