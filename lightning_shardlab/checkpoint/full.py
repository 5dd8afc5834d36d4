"""Full (unsharded) state dicts of the model and of its optimizers, and loading them back into shards.

A full state dict has exactly the keys and shapes of the unsharded module's ``state_dict()``; a full
optimizer state dict is what the same torch optimizer would hold on the unsharded model (state keyed
by parameter index, tensors in the parameters' shapes). So a full checkpoint (``state_dict_type="full"``)
is a plain Lightning checkpoint, and loading one works at any world size and any stage: each rank
slices out its shard.

Gathering holds no more than necessary: one flat parameter at a time is all-gathered (every rank holds
that one full buffer only while it is copied out); rank 0, which writes the single file, keeps the CPU
copies. The file is written by rank 0 under a temporary name and renamed into place (checkpoint/atomic.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_per_element, state_shape
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel


def full_state_dict(sharded: ShardedModel, ema: bool = False) -> dict[str, Any]:
    """Collective. The unsharded ``module.state_dict()`` as CPU tensors on rank 0; ``{}`` elsewhere. With
    ``ema``, the averaged weights and buffers (ShardLabEMA) instead."""
    averages = sharded.averages
    if ema and averages is None:
        raise ValueError(
            "full_state_dict(ema=True) needs averaged weights, and there are none. HINT: train with"
            " callbacks=[lightning_shardlab.ShardLabEMA(...)]."
        )
    sharded.adopt_replaced()
    with placeholders_allowed():
        keyed = sharded.module.state_dict(keep_vars=True)
    if ema:
        keyed = {k: averages.buffers.get(k, v) for k, v in keyed.items()}
    values: dict[int, Tensor] = {}  # id(original param) -> its full value
    for fp in sharded.flat_params:
        full = sharded.gather_full(fp, averages.shard_of(sharded, fp) if ema else None)  # 1-D, padded_numel
        if sharded.comm.rank == 0:
            for slot, param in zip(fp.layout.slots, fp.params):
                value = full[slot.offset : slot.offset + slot.numel].view(slot.shape).detach().to("cpu", copy=True)
                values[id(param)] = value
    if sharded.comm.rank != 0:
        return {}
    # keyed by the module's names now (torch.nn.utils.prune renames weight to weight_orig), as under DDP
    return {k: values[id(v)] if id(v) in values else _cpu(v) for k, v in keyed.items()}


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value


def load_full_state_dict(sharded: ShardedModel, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Every rank: load an unsharded state dict, keeping only this rank's shard of each parameter."""
    with placeholders_allowed():
        expected = sharded.module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise KeyError(
                f"the state dict does not match {type(sharded.module).__name__}: missing {missing[:5]}, unexpected"
                f" {unexpected[:5]}. HINT: load a checkpoint of the same model, or pass strict=False."
            )
    param_keys = set()
    for fp in sharded.flat_params:
        names = [next((f for f in slot.fqns if f in state_dict), None) for slot in fp.layout.slots]
        param_keys.update(f for slot in fp.layout.slots for f in slot.fqns)
        if None in names:
            continue  # strict=False and a parameter is absent: keep its current values
        for slot, name in zip(fp.layout.slots, names):
            if tuple(state_dict[name].shape) != tuple(slot.shape):
                raise ValueError(
                    f"{name!r} has shape {tuple(state_dict[name].shape)} in the state dict but {tuple(slot.shape)}"
                    " in the model. HINT: load a checkpoint of the same model configuration."
                )
        _load_flat_param(fp, [state_dict[n] for n in names])
    rest = {k: v for k, v in state_dict.items() if k not in param_keys}
    sharded.module.load_state_dict(rest, strict=False)


def _load_flat_param(fp: FlatParam, values: list[Tensor]) -> None:
    fp.load(fp.flatten(values))


def load_full_averages(sharded: ShardedModel, state_dict: Mapping[str, Any]) -> bool:
    """Every rank: this rank's slices of a full averaged state dict (``ema_state_dict``) into the averaged
    shards. False (nothing loaded) when it lacks a parameter of a trainable flat parameter."""
    for fp, avg in zip(sharded.flat_params, sharded.averages.shards):
        names = [next((f for f in slot.fqns if f in state_dict), None) for slot in fp.layout.slots]
        if avg is not None and None in names:
            return False
    for fp, avg in zip(sharded.flat_params, sharded.averages.shards):
        if avg is not None:
            start, end = fp.layout.shard_range(fp.rank)
            names = [next(f for f in slot.fqns if f in state_dict) for slot in fp.layout.slots]
            avg.copy_(fp.flatten([state_dict[n] for n in names])[start:end])
    return True


def replicated_state(sharded: ShardedModel) -> dict[str, Any]:
    """The module's ``state_dict()`` entries that are not parameters (buffers, extra state), as CPU copies.
    No communication: each rank's own values."""
    with placeholders_allowed():
        keyed = sharded.module.state_dict(keep_vars=True)
    params = param_names(sharded)
    return {k: _cpu(v) for k, v in keyed.items() if k not in params}


def param_names(sharded: ShardedModel) -> set[str]:
    """Every name of every parameter (tied parameters have several)."""
    return {fqn for fp in sharded.flat_params for slot in fp.layout.slots for fqn in slot.fqns}


def optimizer_index(optimizer: Optimizer, sharded: ShardedModel) -> list[tuple[Tensor, FlatParam, int]]:
    """(master view, its flat param, slot index) for each parameter index of ``optimizer.state_dict()`` (its
    param groups hold the original params; the state tensors have the master views' shapes)."""
    where = {}
    for fp in sharded.flat_params:
        for i, (param, master) in enumerate(zip(fp.params, fp.master_params)):
            where[id(param)] = (master, fp, i)
    return [where[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(optimizer: Optimizer, sharded: ShardedModel) -> dict[str, Any]:
    """Collective. ``optimizer.state_dict()`` as the unsharded optimizer would have it, on rank 0; ``{}`` elsewhere."""
    local = optimizer.state_dict()
    index = optimizer_index(optimizer, sharded)
    layout = [
        (i, key, is_per_element(key, v, state_shape(optimizer, index[i][0].shape)))
        for i, state in local["state"].items()
        for key, v in state.items()
    ]
    scalars = {
        (i, k): v
        for i, s in local["state"].items()
        for k, v in s.items()
        if not is_per_element(k, v, state_shape(optimizer, index[i][0].shape))
    }
    everyone = collectives.all_gather_object((sorted(layout, key=str), scalars), sharded.comm, label="optimizer state")
    union = sorted({entry for keys, _ in everyone for entry in keys}, key=str)
    full_state: dict[int, dict[str, Any]] = {}
    for i, key, elementwise in union:
        _, fp, slot_i = index[i]
        if not elementwise:
            value = next(s[(i, key)] for _, s in everyone if (i, key) in s)
            full_state.setdefault(i, {})[key] = value
    per_fp: dict[int, list[tuple[int, str]]] = {}
    for i, key, elementwise in union:
        if elementwise:
            per_fp.setdefault(id(index[i][1]), []).append((i, key))
    fps = {id(fp): fp for _, fp, _ in index}
    for fp_id, entries in per_fp.items():
        fp = fps[fp_id]
        for key in sorted({k for _, k in entries}):
            # on the device the collective runs on (a master offloaded to host memory is not)
            shard = torch.zeros(fp.layout.shard_numel, dtype=fp.master.dtype, device=sharded.mesh.shard.device)
            members = [i for i, k in entries if k == key]
            for i in members:
                slot = fp.layout.slots[index[i][2]]
                lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
                if i in local["state"] and key in local["state"][i]:
                    shard[lo:hi] = local["state"][i][key].reshape(-1)
            full = torch.empty(fp.layout.padded_numel, dtype=shard.dtype, device=shard.device)
            collectives.all_gather(full, shard, sharded.mesh.shard, label=f"optimizer state {fp.layout.name}")
            if sharded.comm.rank == 0:
                for i in members:
                    slot = fp.layout.slots[index[i][2]]
                    value = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to("cpu", copy=True)
                    full_state.setdefault(i, {})[key] = value
    if sharded.comm.rank != 0:
        return {}
    return {"state": {i: full_state[i] for i in sorted(full_state)}, "param_groups": local["param_groups"]}


def load_full_optimizer_state(optimizer: Optimizer, sharded: ShardedModel, state_dict: Mapping[str, Any]) -> None:
    """Every rank: load an unsharded optimizer state dict, keeping this rank's slice of each tensor."""
    index = optimizer_index(optimizer, sharded)
    groups = state_dict["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(
            "the optimizer state has param groups of sizes"
            f" {[len(g['params']) for g in groups]} but the optimizer has"
            f" {[len(g['params']) for g in optimizer.param_groups]}. HINT: resume with the same configure_optimizers()."
        )
    sliced: dict[int, dict[str, Any]] = {}
    for i, state in state_dict["state"].items():
        master, fp, slot_i = index[int(i)]
        slot = fp.layout.slots[slot_i]
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
        start = fp.layout.shard_range(fp.rank)[0]
        a, b = start + lo - slot.offset, start + hi - slot.offset  # this rank's part, in the parameter's elements
        sliced[int(i)] = {
            k: v.reshape(-1)[a:b].clone() if is_per_element(k, v, state_shape(optimizer, slot.shape)) else v
            for k, v in state.items()
        }
    optimizer.load_state_dict({"state": sliced, "param_groups": groups})
