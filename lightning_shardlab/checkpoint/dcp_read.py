"""Reading a torch Distributed Checkpoint (DCP) directory: element runs of its tensors, through DCP's own
planner and ``FileSystemReader``. Nothing here communicates.

A DCP directory holds ``.metadata`` (a pickle: every tensor's global shape, dtype and saved chunks, and where
each chunk's bytes are) and the data files ``__<rank>_<n>.distcp``. ``.metadata`` is unpickled only through
``DcpReader.open``, which the loaders call only when the user asked for DCP (``state_dict_type="dcp"``, or
``--format dcp`` on the command line): an arbitrary path is never sniffed and unpickled (docs/checkpoints.md).

A read is a list of *runs*: the row-major elements ``[a, b)`` of one saved tensor, into a 1-D tensor of ``b - a``
elements. Each run is cut into boxes (checkpoint/dcp_boxes.py), and ``create_read_items_for_chunk_list``, the
function DCP's default planner uses for a DTensor's shard, computes which saved chunks overlap each box and which
part of each to copy. The reader opens only the files holding those chunks and reads only their byte ranges
(DCP reads a stored chunk whole, then narrows it), and copies straight into the destination: no rank holds more
than its runs and one saved chunk at a time. ``dcp.load`` runs with ``no_dist=True``, so DCP itself issues no
collective: the ranks' agreement is the checkpoint loader's one verdict (checkpoint/save_load.py), through
comm/collectives.py like every other.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_byteio,
    create_read_items_for_chunk_list,
)

from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.dcp_boxes import run_boxes

METADATA = ".metadata"  # DCP's own: the pickled Metadata
META = "meta.pt"  # Lightning's FSDP and ModelParallel strategies: the rest of the Lightning checkpoint


def is_dcp(path: str | Path) -> bool:
    """Whether ``path`` is a DCP directory (by its file names only: nothing is opened)."""
    path = Path(path)
    return path.is_dir() and (path / METADATA).is_file()


def not_asked(path: str | Path) -> str:
    """Why a DCP directory is refused when DCP was not asked for."""
    return (
        f"{path} is a torch Distributed Checkpoint (DCP) directory; its .metadata is a pickle, which can run code"
        " when loaded, so shardlab reads DCP only when asked. HINT: if you trust it, load it"
        " with state_dict_type='dcp' (the ShardLabStrategy of the Trainer or of Fabric), or `shardlab inspect PATH"
        " --format dcp`."
    )


class Run(NamedTuple):
    """Elements ``[a, b)`` (row-major) of the saved tensor ``key``, into ``out`` (1-D, ``b - a`` elements)."""

    key: str
    a: int
    b: int
    out: Tensor


class DcpReader:
    """An opened DCP directory: its metadata, and reads of runs and of non-tensor entries."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        self.path, self.metadata = path, metadata
        entries = metadata.state_dict_metadata
        self.tensors = {k: m for k, m in entries.items() if isinstance(m, TensorStorageMetadata)}
        self.objects = [k for k, m in entries.items() if isinstance(m, BytesStorageMetadata)]

    @staticmethod
    def open(path: str | Path) -> DcpReader:
        """Unpickle ``.metadata`` (call only when DCP was asked for) and check that every data file it names is
        there, at least as long as the bytes it should hold. Raises ``CheckpointError`` naming the file."""
        path = Path(path)
        if not is_dcp(path):
            raise CheckpointError(
                f"{path} is not a torch Distributed Checkpoint directory (no {METADATA} in it). HINT: pass the"
                " directory that dcp.save wrote (it holds .metadata and __*_*.distcp files)."
            )
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"{path / METADATA} cannot be read ({type(err).__name__}: {err}). HINT: the save may not have"
                " finished; DCP writes .metadata last."
            ) from None
        _check_files(path, metadata)
        return DcpReader(path, metadata)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def whole(self, key: str) -> Run:
        """A run of all of ``key``'s elements, into a new tensor of its saved dtype."""
        n = torch.Size(self.shape(key)).numel()
        return Run(key, 0, n, torch.empty(n, dtype=self.dtype(key)))

    def read(self, runs: Iterable[Run], objects: Iterable[str] = ()) -> dict[str, Any]:
        """Fill every run's ``out``; return the non-tensor entries ``objects`` (unpickled weights-only)."""
        planner = _RunPlanner(list(runs), list(objects))
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(self.path)), planner=planner, no_dist=True)
        return planner.values


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata names exists, holding at least the bytes it should (DCP keeps no sums)."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size} bytes, {end} expected"
            raise CheckpointError(
                f"{file} is {found}: the DCP checkpoint {path} is incomplete or damaged. HINT: copy the whole"
                " directory again, or load an earlier checkpoint."
            )


class _RunPlanner(DefaultLoadPlanner):
    """DCP's default load planner, asked for element runs instead of a state dict's tensors."""

    def __init__(self, runs: list[Run], objects: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.runs, self.object_keys = runs, objects
        self.views: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        self.values: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        entries = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for run in self.runs:
            md = entries[run.key]
            for box in run_boxes(tuple(md.size), run.a, run.b):
                view = run.out[box.start - run.a : box.start - run.a + box.numel].view(box.sizes)
                self.views[(run.key, box.offsets)] = view
                chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
                items += create_read_items_for_chunk_list(run.key, md, [chunk])
        for key in self.object_keys:
            items.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        index = read_item.dest_index
        view = self.views[(index.fqn, tuple(index.offset))]
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.values[key] = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"the entry {key!r} of the DCP checkpoint is not plain data ({type(err).__name__}: {err}). HINT:"
                " shardlab reads param groups and numbers from it; save other objects in meta.pt."
            ) from None
