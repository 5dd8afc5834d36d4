"""``shardlab export SRC DST --format dcp``: a shardlab checkpoint becomes a torch Distributed Checkpoint (DCP)
directory, in one process, one tensor at a time.

The layout is the one ``state_dict_type="dcp"`` writes (checkpoint/dcp_save.py): ``{"state_dict": weights,
"optimizer_0": get_state_dict's optimizer layout, ...}``, the rest of the Lightning checkpoint in ``meta.pt``; so
``fully_shard`` at any world size ``dcp.load``s it, and shardlab resumes it with ``state_dict_type="dcp"``. A sharded
SRC names every optimizer's parameters (its metadata), so the optimizer state comes along, keyed by name; a full
file keeps optimizer state by parameter index only, which no name can be given to without the module, so from a
full file the weights alone are written (and the message says so).

Memory: each tensor is read from the memory-mapped shards (checkpoint/consolidate.py's ``Deferred``) only when DCP's
writer asks for it, written, and dropped; a full file is memory-mapped. ``dcp.save`` runs with ``no_dist=True``:
this process is the only writer (``__0_0.distcp``). Written under a temporary name and renamed into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lightning_shardlab.checkpoint.atomic import CheckpointError, commit, delete, new_id, tmp_path
from lightning_shardlab.checkpoint.consolidate import consolidated_checkpoint
from lightning_shardlab.checkpoint.dcp_read import META
from lightning_shardlab.checkpoint.dcp_save import MODEL_KEY, OPTIMIZER_KEY, PiecesSavePlanner
from lightning_shardlab.checkpoint.fabric_state import full_parts
from lightning_shardlab.checkpoint.format import CheckpointReader, shards_of
from lightning_shardlab.checkpoint.stream_save import Deferred


class DeferredSavePlanner(PiecesSavePlanner):
    """Writes ``Deferred`` tensors whole, reading each only when the writer asks for it."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        deferred = [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([0] * len(obj.shape))),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([0] * len(obj.shape)), sizes=obj.shape),
                    properties=TensorProperties(dtype=obj.dtype),
                    size=obj.shape,
                ),
            )
            for fqn, obj in self.state_dict.items()
            if isinstance(obj, Deferred)
        ]
        items = [i for i in plan.items if not isinstance(self.state_dict.get(i.index.fqn), Deferred)]
        self.plan = SavePlan(items + deferred, planner_data=plan.planner_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, Deferred):
            out = torch.empty(obj.shape.numel(), dtype=obj.dtype)
            obj.fill(out=out)
            return out.view(obj.shape)
        return super().resolve_data(write_item)


def export_dcp(src: str | Path, dst: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Write the DCP directory ``dst`` from the shardlab checkpoint ``src``. Raises ``CheckpointError`` or
    ``ValueError`` naming what is wrong; nothing is left at ``dst`` then."""
    src, final = Path(src), Path(dst).absolute()
    if final.exists():
        raise ValueError(f"DST {dst} exists. HINT: export into a new directory (or remove it first).")
    sharded = src.is_dir() or shards_of(src) is not None
    if sharded:
        names = [o["params"] for o in CheckpointReader.open(src).meta["optimizers"]]
        checkpoint = consolidated_checkpoint(src, weights_only, deferred=True)
    else:
        try:
            checkpoint = torch.load(src, map_location="cpu", mmap=True, weights_only=weights_only)
        except Exception as err:  # noqa: BLE001  (a missing or damaged file is the same verdict)
            raise CheckpointError(f"{src} is not a readable checkpoint ({err}). HINT: check the path.") from None
        names = []
    weights, optimizers = full_parts(checkpoint)
    state: dict[str, Any] = {MODEL_KEY: dict(weights)}
    for o, (optimizer, params) in enumerate(zip(optimizers, names)):
        state[OPTIMIZER_KEY.format(o)] = _named(optimizer, params)
    held = {id(weights), *map(id, optimizers)}
    meta = {k: v for k, v in checkpoint.items() if id(v) not in held and k not in ("state_dict", "optimizer_states")}
    tmp = tmp_path(final, new_id())
    try:
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        dcp.save(state, storage_writer=writer, planner=DeferredSavePlanner(), no_dist=True)
        torch.save(meta, tmp / META)
        commit(tmp, final)
    finally:
        delete(tmp)
    tensors = sum(isinstance(v, (Tensor, Deferred)) for v in weights.values())
    return {"tensors": tensors, "optimizers": len(names), "dropped_optimizers": len(optimizers) - len(names)}


def _named(optimizer: dict[str, Any], params: list[str]) -> dict[str, Any]:
    """An unsharded optimizer state (keyed by parameter index) in ``get_state_dict``'s layout (keyed by name)."""
    state = {params[int(j)]: dict(values) for j, values in optimizer["state"].items()}
    groups = [{**g, "params": [params[int(j)] for j in g["params"]]} for g in optimizer["param_groups"]]
    return {"state": state, "param_groups": groups}
