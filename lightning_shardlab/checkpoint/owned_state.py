"""Whole-tensor optimizers' state in a sharded checkpoint: each owner's own file (checkpoint/format.py's note).

Muon and Adafactor keep a parameter's state whole, on the one rank that owns the parameter
(sharding/owners.py). Saved, each owner writes the state of the parameters it owns, whole and as it holds it
(Muon's momentum in the parameter's shape, Adafactor's row and column statistics, step counters), into
``owned-r-of-W.pt`` (r: its rank in the world of W ranks); metadata.json's ``optimizers[o].owned`` says, per
parameter index, which file holds that parameter's state and each tensor's dtype and shape. Nothing of it
passes through another rank or through rank 0.

Loaded at any world size or stage, owners are assigned again (the same rule on the saved names and sizes,
so every rank knows the new owners before any collective), and each new owner reads the state of the
parameters it owns from the files that hold it: the only owned files a rank verifies and opens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.format import CheckpointReader, dtype_name, owned_file
from lightning_shardlab.sharding.flat_param import FlatParam
from lightning_shardlab.sharding.optimizer import is_whole_tensor
from lightning_shardlab.sharding.owners import assign_owners

Index = list[tuple[Tensor, FlatParam, int]]  # checkpoint/full.py's optimizer_index


def owned_key(optimizer: int, key: str, name: str) -> str:
    """The name of one owned state tensor in an owner's file: optimizer, state key, parameter."""
    return f"optim{optimizer}/{key}/{name}"


def param_name(index: Index, j: int) -> str:
    _, fp, i = index[j]
    return fp.layout.slots[i].name


def summarize(state: Mapping[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """(tensors, the rest) of a whole-tensor optimizer's local state by parameter index: each tensor's dtype and
    shape (saved in this rank's owned file), and the other values (kept with the trainer state)."""
    tensors: dict[int, dict[str, Any]] = {}
    rest: dict[int, dict[str, Any]] = {}
    for j, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors.setdefault(j, {})[key] = {"dtype": dtype_name(value.dtype), "shape": list(value.shape)}
            else:
                rest.setdefault(j, {})[key] = value
    return tensors, rest


def agree(owned_by_rank: list[dict[int, dict[str, Any]]], count: int, world_size: int) -> list[dict[str, Any] | None]:
    """Per parameter index (``count`` of them): the file that holds its state and its tensors, or None."""
    record: list[dict[str, Any] | None] = [None] * count
    for rank, owned in enumerate(owned_by_rank):
        for j, tensors in owned.items():
            record[int(j)] = {"file": owned_file(rank, world_size), "tensors": tensors}
    return record


def owned_tensors(
    optimizers: list[Optimizer], states: list[Mapping[str, Any]], indexes: list[Index], copy: bool
) -> dict[str, Tensor]:
    """This rank's owned file: the whole state tensors of the parameters it owns, as CPU tensors (copies taken
    now with ``copy``: an asynchronous save, while training goes on)."""
    out = {}
    for o, (optimizer, state, index) in enumerate(zip(optimizers, states, indexes)):
        if not is_whole_tensor(optimizer):
            continue
        for j, entries in state["state"].items():
            for key, value in entries.items():
                if isinstance(value, Tensor):
                    cpu = value.detach().to("cpu", copy=copy)
                    out[owned_key(o, key, param_name(index, j))] = cpu
    return out


def new_owner_files(reader: CheckpointReader, world_size: int, rank: int) -> set[str]:
    """The owned files that ``rank`` will read: those holding the state of parameters it will own."""
    files = set()
    for record in reader.meta["optimizers"]:
        owned = record.get("owned")
        if owned:
            owners = _new_owners(reader, record["params"], world_size)
            files |= {e["file"] for name, e in zip(record["params"], owned) if e and owners[name] == rank}
    return files


def _new_owners(reader: CheckpointReader, names: list[str], world_size: int) -> dict[str, int]:
    """The owners a run of ``world_size`` ranks assigns (sharding/whole_step.py's plan: names and sizes alone)."""
    return assign_owners([(n, reader.where[n][1].numel) for n in names], world_size)


def read_owned(reader: CheckpointReader, o: int, j: int) -> dict[str, Tensor]:
    """Parameter ``j``'s saved state of whole-tensor optimizer ``o`` (empty when it had none), as copies."""
    entry = reader.meta["optimizers"][o]["owned"][j]
    return {key: read_one(reader, o, j, key) for key in entry["tensors"]} if entry else {}


def read_one(reader: CheckpointReader, o: int, j: int, key: str, out: Tensor | None = None) -> Tensor:
    """State ``key`` of parameter ``j`` of whole-tensor optimizer ``o``, checked against the metadata: a copy,
    or written into ``out`` (1-D, as many elements) and returned flat."""
    record = reader.meta["optimizers"][o]
    entry = record["owned"][j]
    expected = entry["tensors"][key]
    name = owned_key(o, key, record["params"][j])
    value = reader.owned(entry["file"]).get(name)
    if value is None or dtype_name(value.dtype) != expected["dtype"] or list(value.shape) != expected["shape"]:
        found = "nothing" if value is None else f"{dtype_name(value.dtype)} of shape {tuple(value.shape)}"
        raise CheckpointError(
            f"checkpoint file {reader.path / entry['file']} holds {found} under {name!r}, expected"
            f" {expected['dtype']} of shape {tuple(expected['shape'])}. HINT: the checkpoint was damaged or"
            " mixed with another one's files."
        )
    return value.clone() if out is None else out.copy_(value.reshape(-1))


def keys_of(record: Mapping[str, Any]) -> list[str]:
    """The state keys a whole-tensor optimizer's record holds whole (for ``shardlab inspect``)."""
    return sorted({k for e in record.get("owned") or [] if e for k in e["tensors"]})
