"""Loading a torch Distributed Checkpoint (DCP) into shards, at any world size and stage: the weights, and the
optimizer state where the optimizer matches, by parameter name. Reading is checkpoint/dcp_read.py; writing
checkpoint/dcp_save.py.

What a DCP checkpoint holds is what its writer saved: torch's ``get_state_dict`` layout for an FSDP2 module and
its optimizers (``{fqn: tensor}``, and ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [{...,
"params": [fqn, ...]}]}``) under the writer's own top-level keys, flattened with dots. Each rank asks only for its
own elements of each parameter (a run of the flat parameter's shard: ``runs``) and of each per-element optimizer
state tensor (a tensor of the parameter's shape other than ``step``); the rest (``step``, buffers) is read whole.
Names are matched as the source wrote them (checkpoint/dcp_names.py). An optimizer's state is found through
its ``param_groups`` entry, which names its parameters; a checkpoint without one loads the weights and the
optimizers start fresh (with a warning). Whole-tensor optimizers (Muon, Adafactor) keep their state on owner
ranks in another shape and are refused.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning
import torch
from torch.optim import Optimizer

from lightning_shardlab.checkpoint.dcp_names import match, mismatch
from lightning_shardlab.checkpoint.dcp_read import META, DcpReader, Run
from lightning_shardlab.checkpoint.full import optimizer_index
from lightning_shardlab.sharding.flat_param import FlatParam, ParamSlot
from lightning_shardlab.sharding.optimizer import is_whole_tensor
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel

PARAM_GROUPS = "param_groups"


def runs(fp: FlatParam) -> Iterator[tuple[ParamSlot, int, int, int, int]]:
    """(slot, [lo, hi) in this rank's shard, [a, b) in the parameter's row-major elements) for every parameter
    part this rank's shard of ``fp`` holds."""
    start = fp.layout.shard_range(fp.rank)[0]
    for slot in fp.layout.slots:
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
        if hi > lo:
            yield slot, lo, hi, start + lo - slot.offset, start + hi - slot.offset


def open_checkpoint(path: Path, weights_only: bool | None) -> tuple[DcpReader, dict[str, Any]]:
    """Not collective: open the DCP directory (its metadata checked) and the Lightning checkpoint around it:
    ``meta.pt`` when the writer left one (Lightning's strategies and ours do), else only what Lightning needs to
    resume the weights and optimizers (loops, schedulers and callbacks then start fresh)."""
    reader = DcpReader.open(path)
    meta = path / META
    checkpoint = torch.load(meta, map_location="cpu", weights_only=weights_only) if meta.is_file() else {}
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
    checkpoint.setdefault("optimizer_states", [])  # read from the DCP files by load_optimizers
    checkpoint.setdefault("lr_schedulers", [])
    checkpoint["state_dict"] = {}  # read from the DCP files by load_model
    return reader, checkpoint


# ---- weights ----


def load_model(sharded: ShardedModel, reader: DcpReader, strict: bool) -> None:
    """Collective (stages 1-2 re-gather): every rank reads its runs of every parameter, and the buffers whole."""
    with placeholders_allowed():
        keys = list(sharded.module.state_dict(keep_vars=True))
    slots = [slot for fp in sharded.flat_params for slot in fp.layout.slots]
    param_keys = {f for slot in slots for f in slot.fqns}
    buffers = [k for k in keys if k not in param_keys]
    ours = [list(slot.fqns) for slot in slots] + [[k] for k in buffers]
    found, prefix = match(ours, model_keys(reader))
    if strict and None in found:
        missing = [names[0] for names, key in zip(ours, found) if key is None]
        unused = sorted(set(model_keys(reader, prefix)) - set(found))
        hint = "load a checkpoint of the same model, or set strict_loading=False (Trainer) / strict=False (Fabric)."
        raise KeyError(mismatch(type(sharded.module).__name__, missing, unused, str(reader.path), hint))
    saved = dict(zip((slot.name for slot in slots), found))
    for slot in slots:
        key = saved[slot.name]
        if key is not None and reader.shape(key) != tuple(slot.shape):
            raise ValueError(
                f"{key!r} has shape {reader.shape(key)} in the DCP checkpoint {reader.path} but {tuple(slot.shape)} in"
                f" the model ({slot.name!r}). HINT: load a checkpoint of the same model configuration."
            )
    todo = []
    for fp in sharded.flat_params:
        for slot, lo, hi, a, b in runs(fp):
            if saved[slot.name] is not None:  # strict=False and absent: keep its current values
                todo.append(Run(saved[slot.name], a, b, fp.master[lo:hi]))
    whole = {k: reader.whole(key) for k, key in zip(buffers, found[len(slots) :]) if key in reader.tensors}
    with torch.no_grad():
        reader.read([*todo, *whole.values()])
    sharded.refresh(set(sharded.flat_params))  # the compute copies: resident (stages 1-2) or gathered units
    values = {k: run.out.view(reader.shape(run.key)) for k, run in whole.items()}
    sharded.module.load_state_dict(values, strict=False)


def model_keys(reader: DcpReader, prefix: str = "") -> list[str]:
    """The saved tensors that are not optimizer state, under ``prefix``."""
    optimizers = tuple(o + part for o in optimizer_records(reader) for part in ("state.", "param_groups."))
    return [k for k in reader.tensors if k.startswith(prefix) and not k.startswith(optimizers)]


# ---- optimizers ----


GROUP_ENTRY = re.compile(r"^(?:(.*)\.)?param_groups\.(\d+)\.([^.]+)$")  # a flattened param group's setting


def optimizer_records(reader: DcpReader) -> dict[str, dict[int, dict[str, str]]]:
    """Per optimizer saved (its keys' prefix, in the writer's order: ``optimizer_0``, ``optimizer_1``, ... by
    number), per param group, the key of each of its entries (``lr``, ``params``, ...). DCP flattens
    ``get_state_dict``'s ``param_groups`` list into one entry per group and setting."""
    found: dict[str, dict[int, dict[str, str]]] = {}
    for key in [*reader.objects, *reader.tensors]:
        m = GROUP_ENTRY.match(key)
        if m is not None:
            prefix = f"{m[1]}." if m[1] else ""
            found.setdefault(prefix, {}).setdefault(int(m[2]), {})[m[3]] = key
    usable = {p: groups for p, groups in found.items() if all("params" in g for g in groups.values())}
    order = sorted(usable, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)])
    return {p: dict(sorted(usable[p].items())) for p in order}


def load_optimizers(optimizers: list[Optimizer], sharded: ShardedModel, reader: DcpReader) -> None:
    """Every rank: each optimizer's state, this rank's runs of each per-element tensor, matched by name."""
    records = optimizer_records(reader)
    if not records:
        if sharded.comm.rank == 0:
            warnings.warn(
                f"the DCP checkpoint {reader.path} holds no optimizer state (no param_groups entry): the weights are"
                " loaded and the optimizers start fresh.",
                stacklevel=3,
            )
        return
    refused = [type(o).__name__ for o in optimizers if is_whole_tensor(o)]
    if refused or len(records) != len(optimizers):
        raise ValueError(
            f"the DCP checkpoint {reader.path} holds {len(records)} optimizer states ({list(records)}) but"
            f" configure_optimizers() made {len(optimizers)}{f' (whole-tensor: {refused})' if refused else ''}."
            " HINT: resume with the same number of elementwise optimizers (AdamW, Adam, SGD, ...); a whole-tensor"
            " optimizer's state is not in torch's per-parameter layout."
        )
    for optimizer, (prefix, groups) in zip(optimizers, records.items()):
        _load_one(optimizer, sharded, reader, prefix, _read_groups(reader, groups))


def _read_groups(reader: DcpReader, groups: dict[int, dict[str, str]]) -> list[dict[str, Any]]:
    """The saved param groups, as ``get_state_dict`` gave them (``params``: parameter names)."""
    objects = [k for g in groups.values() for k in g.values() if k in reader.objects]
    tensors = {k: reader.whole(k) for g in groups.values() for k in g.values() if k in reader.tensors}
    values = reader.read(tensors.values(), objects)
    values.update({k: run.out.view(reader.shape(k)) for k, run in tensors.items()})
    return [{setting: values[key] for setting, key in g.items()} for g in groups.values()]


def _load_one(optimizer: Optimizer, sharded: ShardedModel, reader: DcpReader, prefix: str, saved: list) -> None:
    index = optimizer_index(optimizer, sharded)
    ours = [list(fp.layout.slots[i].fqns) for _, fp, i in index]
    names = [name for group in saved for name in group["params"]]
    found, _ = match(ours, names)
    if None in found or len(names) != len(ours):
        missing = [o[0] for o, f in zip(ours, found) if f is None]
        hint = "resume with the same configure_optimizers() (the same parameters in its param groups)."
        raise ValueError(mismatch(type(optimizer).__name__, missing, sorted(set(names) - set(found)), prefix, hint))
    groups = _groups(optimizer, saved, found, prefix, reader)
    states = {f"{prefix}state.{name}.": j for j, name in enumerate(found)}
    todo: list[Run] = []
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key in reader.tensors:
        head, _, what = key.rpartition(".")
        j = states.get(head + ".")
        if j is None:
            continue
        _, fp, slot_i = index[j]
        slot = fp.layout.slots[slot_i]
        if what != "step" and reader.shape(key) == tuple(slot.shape):  # per element: this rank's run
            lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
            a = fp.layout.shard_range(fp.rank)[0] + lo - slot.offset
            out = torch.empty(max(hi - lo, 0), dtype=fp.master.dtype)  # 1-D: the master view's shape
            if hi > lo:  # else this rank holds none of the parameter
                todo.append(Run(key, a, a + hi - lo, out))
            state.setdefault(j, {})[what] = out
        else:
            run = reader.whole(key)
            todo.append(run)
            state.setdefault(j, {})[what] = run.out.view(reader.shape(key))
    reader.read(todo)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _groups(optimizer: Optimizer, saved: list, found: list[str | None], prefix: str, reader: DcpReader) -> list:
    """Our param groups (parameter indices) with the saved settings (lr, betas, ...) of the group holding the
    same parameters; refused when the parameters are grouped otherwise."""
    ours = optimizer.state_dict()[PARAM_GROUPS]
    where = {name: g for g, group in enumerate(saved) for name in group["params"]}
    out = []
    for group in ours:
        homes = {where[found[j]] for j in group["params"]}
        if len(homes) != 1 or len(saved[next(iter(homes))]["params"]) != len(group["params"]):
            raise ValueError(
                f"{type(optimizer).__name__}'s param groups hold other parameters together than the optimizer saved"
                f" under {prefix!r} in the DCP checkpoint {reader.path}. HINT: build the param groups as the run that"
                " saved it did."
            )
        settings = {k: v for k, v in saved[homes.pop()].items() if k != "params"}
        out.append({**group, **settings})
    return out
