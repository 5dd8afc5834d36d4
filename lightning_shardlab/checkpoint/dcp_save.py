"""The collective save of ``state_dict_type="dcp"``: a torch Distributed Checkpoint (DCP) directory in the layout
torch's ``get_state_dict`` gives for an FSDP2 module and its optimizers, so that ``fully_shard`` at any world size
loads it with ``dcp.load`` and ``dcp_to_torch_save`` makes one file of it.

The state saved is Lightning's layout for DCP (its FSDP and ModelParallel strategies)::

    {"state_dict":  {fqn: weight, ...buffers},                        the module's state_dict() keys
     "optimizer_0": {"state": {fqn: {"step": t, "exp_avg": w, ...}},  get_optimizer_state_dict's layout
                     "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]},
     ...}

with the rest of the Lightning checkpoint (loops, schedulers, callbacks, hyperparameters) in ``meta.pt`` beside it,
as Lightning writes it. A parameter is saved in its master dtype. Each rank writes its own elements of every
parameter and per-element optimizer state tensor, the boxes of its runs (checkpoint/dcp_boxes.py), as DCP chunks of
the global tensor: DCP's metadata then describes the global tensors exactly as for a DTensor's shards, and any
reader (FSDP2's ``Shard(0)`` at any world size, ``dcp_to_torch_save``) reads across them. With hybrid sharding the
first replica group writes the shards. Replicated values (``step``, buffers) go to rank 0's file, param groups too.

The protocol is ``dcp.save``'s, through our collectives (comm/collectives.py: counted, verified, seen by the
watchdog): every rank plans its writes (DCP's ``DefaultSavePlanner``, asked for chunks), rank 0 makes the global
plan (DCP checks that the chunks of each tensor cover it exactly once), every rank writes its file, rank 0 writes
``.metadata`` and ``meta.pt``. All of it goes into ``<name>.tmp-<id>``, which is renamed onto ``<name>`` once
complete (checkpoint/atomic.py): a save killed at any moment leaves the previous checkpoint of that name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.optim import Optimizer

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
)
from lightning_shardlab.checkpoint.dcp_boxes import Box, run_boxes
from lightning_shardlab.checkpoint.dcp_load import runs
from lightning_shardlab.checkpoint.dcp_read import META, METADATA
from lightning_shardlab.checkpoint.format import shards_of
from lightning_shardlab.checkpoint.full import optimizer_index
from lightning_shardlab.comm import collectives
from lightning_shardlab.sharding.optimizer import is_per_element, is_whole_tensor
from lightning_shardlab.sharding.sharded_model import ShardedModel

MODEL_KEY = "state_dict"  # Lightning's keys in a DCP checkpoint (its ModelParallelStrategy)
OPTIMIZER_KEY = "optimizer_{}"


class Pieces:
    """This rank's elements of one global tensor of ``shape``: 1-D ``values`` in row-major order, the first of
    them element ``a``. Saved as one DCP chunk per box of the run."""

    def __init__(self, shape: torch.Size, a: int, values: Tensor) -> None:
        self.shape, self.a, self.values = torch.Size(shape), a, values.detach()
        self.boxes = {b.offsets: b for b in run_boxes(tuple(shape), a, a + values.numel())}

    def write_items(self, fqn: str) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.values.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for b in self.boxes.values()
        ]

    def box(self, offsets: tuple[int, ...]) -> Tensor:
        b: Box = self.boxes[tuple(offsets)]
        return self.values[b.start - self.a : b.start - self.a + b.numel].view(b.sizes)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, writing ``Pieces`` as chunks; plain values are written by rank 0 (tensors by
    any rank that has them: DCP's deduplication keeps one)."""

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, Pieces):
                items += obj.write_items(fqn)
            elif isinstance(obj, Tensor) or self.is_coordinator:
                items += _create_write_items(fqn, obj)
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, Pieces):
            return obj.box(tuple(write_item.index.offset))
        return super().resolve_data(write_item)


def state_to_save(checkpoint: dict[str, Any], sharded: ShardedModel, optimizers: list[Optimizer]) -> dict[str, Any]:
    """This rank's part of the state, in ``get_state_dict``'s layout under Lightning's keys. Needs no
    communication: ``checkpoint`` holds this rank's replicated entries and local optimizer states."""
    writes = sharded.mesh.replica.rank == 0  # hybrid sharding: the first replica group writes the shards
    model: dict[str, Any] = {}
    for fp in sharded.flat_params:
        for slot, lo, hi, a, _ in runs(fp) if writes else ():
            for fqn in slot.fqns:  # tied parameters under each of their names, as module.state_dict() has them
                model[fqn] = Pieces(slot.shape, a, fp.master[lo:hi])
        for slot in fp.layout.slots:
            if slot.numel == 0:  # no rank holds an element: a whole empty tensor keeps the key
                model.update({fqn: torch.empty(slot.shape, dtype=fp.master.dtype) for fqn in slot.fqns})
    model.update(checkpoint["state_dict"])  # buffers and extra state (replicated)
    state = {MODEL_KEY: model}
    for o, (optimizer, local) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
        state[OPTIMIZER_KEY.format(o)] = _optimizer_state(optimizer, local, sharded, writes)
    return state


def _optimizer_state(optimizer: Optimizer, local: dict[str, Any], sharded: ShardedModel, writes: bool) -> dict:
    index = optimizer_index(optimizer, sharded)
    names = [fp.layout.slots[i].name for _, fp, i in index]
    state: dict[str, dict[str, Any]] = {}
    for j, values in local["state"].items():
        master, fp, slot_i = index[int(j)]
        slot = fp.layout.slots[slot_i]
        lo, hi = fp.layout.slot_in_shard(slot, fp.rank)
        a = fp.layout.shard_range(fp.rank)[0] + lo - slot.offset
        for key, value in values.items():
            if is_per_element(key, value, master.shape):
                if writes and hi > lo:
                    state.setdefault(names[int(j)], {})[key] = Pieces(slot.shape, a, value.reshape(-1))
            else:
                state.setdefault(names[int(j)], {})[key] = value
    groups = [{**g, "params": [names[j] for j in g["params"]]} for g in local["param_groups"]]
    return {"state": state, "param_groups": groups}


def check_dcp_save(sharded: ShardedModel, optimizers: list[Optimizer]) -> None:
    """Before any collective, on every rank: what a DCP checkpoint cannot hold."""
    refused = [type(o).__name__ for o in optimizers if is_whole_tensor(o)]
    if refused:
        raise ValueError(
            f"[rank {sharded.comm.rank}] state_dict_type='dcp' saves optimizer state in torch's per-parameter layout,"
            f" which the whole-tensor optimizers {refused} do not keep (their state lives whole on owner ranks)."
            " HINT: use state_dict_type='sharded' (the default) with them."
        )
    if sharded.averages is not None:
        raise ValueError(
            f"[rank {sharded.comm.rank}] state_dict_type='dcp' has no place for ShardLabEMA's averaged weights."
            " HINT: use state_dict_type='sharded' (the default) with ShardLabEMA."
        )


def save_dcp(
    checkpoint: dict[str, Any], filepath: str | Path, sharded: ShardedModel, optimizers: list[Optimizer]
) -> None:
    """Collective: plan, write, finish, commit; a failure on any rank fails the save on every rank."""
    check_dcp_save(sharded, optimizers)
    comm = sharded.comm
    final = Path(filepath).absolute()
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    agreed = collectives.all_gather_object((str(final), new_id()), comm, label="dcp checkpoint plan")
    same_destination([p for p, _ in agreed], "save")
    tmp = tmp_path(final, agreed[0][1])
    planner, writer = PiecesSavePlanner(), dcp.FileSystemWriter(str(tmp), sync_files=True)
    local = _attempt(
        lambda: _local_plan(planner, writer, state_to_save(checkpoint, sharded, optimizers), comm.rank, final, tmp)
    )
    plans = collectives.all_gather_object(local, comm, label="dcp checkpoint local plans")
    _raise_first(plans, tmp, comm.rank)
    central, metadata = None, None
    if comm.rank == 0:  # the plans go to every rank, the metadata (every chunk of every tensor) stays here
        made, error = _attempt(lambda: _global_plan(planner, writer, [p for p, _ in plans]))
        central, metadata = (made[0] if made else None, error), made[1] if made else None
    central = collectives.broadcast_object(central, comm)
    _raise_first([central], tmp, comm.rank)
    mine, _ = central
    written = _attempt(lambda: _write(planner, writer, mine[comm.rank]))
    results = collectives.all_gather_object(written, comm, label="dcp checkpoint written")
    _raise_first(results, tmp, comm.rank)
    outcome = None
    if comm.rank == 0:
        outcome = _finish(writer, metadata, [r for r, _ in results], meta, tmp, final)
    outcome = collectives.broadcast_object(outcome, comm)
    if outcome is not None:
        raise CheckpointError(outcome)


def _attempt(step: Any) -> tuple[Any, str | None]:
    """(the step's result, None) or (None, its error): every rank learns every rank's outcome."""
    try:
        return step(), None
    except Exception as err:  # noqa: BLE001  (every rank raises it)
        return None, f"{type(err).__name__}: {err}"


def _raise_first(outcomes: list[tuple[Any, str | None]], tmp: Path, rank: int) -> None:
    bad = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
    if bad:
        if rank == 0:
            delete(tmp)
        r, error = bad[0]
        raise CheckpointError(
            f"saving the DCP checkpoint failed on rank {r}, so it was not written (any previous checkpoint of that"
            f" name is unchanged): {error}. HINT: check free space and permissions of {tmp.parent}."
        )


def _local_plan(
    planner: PiecesSavePlanner, writer: dcp.FileSystemWriter, state: dict[str, Any], rank: int, final: Path, tmp: Path
) -> SavePlan:
    if rank == 0:  # what interrupted saves of this name left goes (this save's directory and the shards a
        # sharded checkpoint of the name still names stay: the commit replaces that checkpoint)
        replaced = None if final.is_symlink() else shards_of(final)
        clear_leftovers(final, keep=frozenset(p for p in (tmp, replaced) if p is not None))
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return writer.prepare_local_plan(planner.create_local_plan())


def _global_plan(planner: PiecesSavePlanner, writer: dcp.FileSystemWriter, plans: list[SavePlan]) -> tuple:
    """Rank 0: DCP's global plan (its checks: each tensor's chunks cover it exactly once) and the metadata."""
    plans, metadata = planner.create_global_plan(plans)
    return writer.prepare_global_plan(plans), metadata


def _write(planner: PiecesSavePlanner, writer: dcp.FileSystemWriter, plan: SavePlan) -> list:
    """Every rank: its own file (fsynced: ``sync_files``)."""
    future = writer.write_data(planner.finish_plan(plan), planner)
    future.wait()
    return future.value()


def _finish(
    writer: dcp.FileSystemWriter, metadata: Any, results: list, meta: dict[str, Any], tmp: Path, final: Path
) -> str | None:
    """Rank 0: ``.metadata`` and ``meta.pt``, made durable, then the directory moved onto ``final``."""
    try:
        writer.finish(metadata=metadata, results=results)
        torch.save(meta, tmp / META)
        for name in (METADATA, META):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        commit(tmp, final)
        clear_leftovers(final)
        return None
    except Exception as err:  # noqa: BLE001  (every rank raises it)
        delete(tmp)
        return (
            f"saving the DCP checkpoint {final} failed, so it was not written (any previous checkpoint of that name"
            f" is unchanged): {type(err).__name__}: {err}. HINT: check free space and permissions of {final.parent}."
        )
