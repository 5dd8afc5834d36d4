"""The sharded checkpoint on disk, and reading any slice of it back. Nothing here communicates.

[Note: the sharded checkpoint format] (format version 1)

A sharded checkpoint is a directory, written by N ranks at ZeRO stage s, beside the checkpoint's model file
``<name>`` (which names it: [Note: the model file] in checkpoint/model_file.py)::

    <name>.shards-<id>/                  e.g. "epoch=1-step=8.ckpt.shards-3f2a9c1b7d4e" (a new id per save)
      shard-00000-of-00002.pt            rank 0's slice of every flat parameter and of its optimizer state
      shard-00001-of-00002.pt            rank 1's
      rank-state-00000-of-00002.pt       only when some non-model state differs between ranks: rank 0's values
      rank-state-00001-of-00002.pt       ... rank 1's (see checkpoint/rank_state.py)
      owned-00001-of-00002.pt            with Muon, Adafactor...: the whole state of the parameters rank 1
                                         owned (one per world rank that owned any: checkpoint/owned_state.py)
      trainer_state.pt                   rank 0's Lightning checkpoint minus what the shard files hold
      metadata.json                      the layout, and the size and sha256 of every file above
      COMPLETE                           written last: the size and sha256 of metadata.json

shard-r-of-N.pt (``torch.save`` of a dict of 1-D tensors, loaded with ``weights_only=True, mmap=True``).
For flat parameter f (metadata ``flat_params[f]``, named like ``blocks.0[float32]``) it holds

    "master/<f>"            the master shard (fp32 under mixed precision), unpadded: the elements
                            [r*S, min((r+1)*S, numel)) of f in *flat coordinates*, S = padded_numel / N
    "optim<o>/<key>/<f>"    optimizer o's per-element state ``key`` (exp_avg, momentum_buffer, ...) over
                            the same elements, zeros where a parameter has none
    "ema/<f>"               with ShardLabEMA, the average of the master shard over the same elements
                            (trainable flat parameters only: a frozen one is its own average)

Flat coordinates do not depend on the world size: padding aside, element k of a flat parameter is
element k at every world size (parameters laid end to end in registration order, sharding/flat_param.py).
Loading at another world size or stage, each rank reads only the elements of its new shard, parameter
by parameter (matched by name, so even a different choice of units loads), from the few saved files
that overlap it; files are memory-mapped, so only those byte ranges are read into memory.

trainer_state.pt (``torch.save``): the dict Lightning dumps (loops, callbacks, LR schedulers,
precision plugin state, hyperparameters, epoch, global_step, datamodule and user keys) with
``state_dict`` holding only the module's replicated entries (buffers, extra state) and
``optimizer_states`` holding, per optimizer, ``param_groups`` and the scalar state per parameter index
(``step``); per-element state lives in the shard files. ``shardlab_rank_states`` lists the entries
that differed between ranks (their values are in the rank-state files). ``shardlab_ema`` (with
ShardLabEMA): ``n_averaged``, ``use_buffers`` and the averaged ``buffers``; the averaged parameters are
the ``ema/<f>`` tensors. A full or consolidated checkpoint holds the same record and, under
``ema_state_dict``, the averaged module state dict with the module's own keys.

metadata.json::

    format, version            "shardlab-sharded", 1
    world_size, stage, precision, broadcast_buffers, module (class path)
    replicas                   hybrid sharding: how many shard groups held these shards (the first wrote
                               them; world_size is the shard group's size, the rank-state files the world's)
    state_dict_keys            the module's own ``state_dict()`` keys in order (what consolidation writes)
    flat_params[f]             name, unit, dtype, requires_grad, numel, padded_numel, slots (fqns: every
                               name of the parameter, tied ones have several; shape; offset), and
                               tensors: {"master" | "optim<o>/<key>" | "ema": dtype} that every shard file holds
    optimizers[o]              params: the canonical name of each parameter index, in order;
                               state_keys: each one's per-element state keys;
                               owned (whole-tensor optimizers): per index, null or {file, tensors: {key:
                               {dtype, shape}}}, whose tensors are "optim<o>/<key>/<param>" in that file
    rank_state                 paths of the per-rank entries (readable), their files
    files                      {name: {bytes, sha256}} for every other file

Loading verifies before anything else: the COMPLETE marker (else the save did not finish), metadata.json
against it, every file's size, and the sha256 and tensor names, dtypes and lengths of every file the
rank reads; the ranks agree on the verdict (one small all-gather), so a bad file is refused with the
same error on every rank, naming it.

Why not ``torch.distributed.checkpoint`` (DCP): DCP would express the layout (a flat parameter is a
1-D tensor chunked like DTensor's ``Shard(0)``), but (1) its save and load plans run their own
``torch.distributed`` collectives, outside ``comm/collectives.py``, so the ledger, the sanity fingerprints
and the watchdog would not see them; (2) it has no checksums, so corruption would surface as wrong
numbers or an unpickling error far from the file; (3) it writes into the destination directory in
place, so atomicity and the COMPLETE marker would have to be built around it anyway; (4) per-rank side
state and exact optimizer-state resharding need the flat layout, which we know and DCP does not. The
format above is a few hundred lines, read with plain ``torch.load`` (consolidation needs no process
group), and documented here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shardlab.checkpoint.atomic import CheckpointError, check_file, leftovers
from lightning_shardlab.checkpoint.stream_save import read_record
from lightning_shardlab.offload.mapped_files import drop_pages
from lightning_shardlab.sharding.flat_param import FlatParamLayout, ParamSlot

FORMAT = "shardlab-sharded"
VERSION = 1
COMPLETE = "COMPLETE"
METADATA = "metadata.json"
TRAINER_STATE = "trainer_state.pt"
RANK_STATES_KEY = "shardlab_rank_states"  # in trainer_state.pt, and in a consolidated (full) checkpoint
EMA = "ema"  # the tensor kind of ShardLabEMA's averaged shards
EMA_STATE_DICT = "ema_state_dict"  # in a full (or consolidated) checkpoint: the averaged module state dict
EMA_RECORD = "shardlab_ema"  # in every checkpoint with an average: {"n_averaged", "use_buffers", "buffers"}
MODEL_RECORD = "shardlab.json"  # in a model file (checkpoint/model_file.py): the name of its shard directory


def shards_of(path: str | Path) -> Path | None:
    """The shard directory that the model file at ``path`` names (beside the file that ``path`` is or links to);
    None when ``path`` is not a model file (a directory, a full checkpoint, nothing)."""
    path = Path(path)
    record = read_record(path, MODEL_RECORD) if path.is_file() else None
    if record is None:
        return None
    try:
        name = json.loads(record)["shards"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} has a malformed {MODEL_RECORD} record. HINT: it is damaged.") from None
    return path.resolve().parent / name


def unfinished_saves(final: Path) -> list[Path]:
    """What interrupted saves of ``final`` left (checkpoint/atomic.py), not counting the shards ``final`` names."""
    named = None if final.is_symlink() else shards_of(final)
    return leftovers(final, keep=frozenset([named] if named is not None else []))


def sharded_path(path: str | Path) -> Path:
    """The shard directory of a sharded checkpoint given by its path (a model file) or by the directory itself."""
    return shards_of(path) or Path(path)


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def rank_state_file(rank: int, world_size: int) -> str:
    return f"rank-state-{rank:05d}-of-{world_size:05d}.pt"


def owned_file(rank: int, world_size: int) -> str:
    return f"owned-{rank:05d}-of-{world_size:05d}.pt"


def master_key(fp_name: str) -> str:
    return f"master/{fp_name}"


def optim_key(optimizer: int, key: str, fp_name: str) -> str:
    return f"optim{optimizer}/{key}/{fp_name}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in {METADATA}. HINT: was it written by a newer torch?")
    return dtype


def layout_record(layout: FlatParamLayout, tensors: dict[str, str]) -> dict[str, Any]:
    """One ``flat_params`` entry of metadata.json."""
    return {
        "name": layout.name,
        "unit": layout.unit,
        "dtype": dtype_name(layout.dtype),
        "requires_grad": layout.requires_grad,
        "numel": layout.numel,
        "padded_numel": layout.padded_numel,
        "slots": [{"fqns": list(s.fqns), "shape": list(s.shape), "offset": s.offset} for s in layout.slots],
        "tensors": tensors,
    }


def layout_from_record(record: dict[str, Any], world_size: int) -> FlatParamLayout:
    slots = tuple(ParamSlot(tuple(s["fqns"]), torch.Size(s["shape"]), s["offset"]) for s in record["slots"])
    layout = FlatParamLayout(record["unit"], parse_dtype(record["dtype"]), record["requires_grad"], slots, world_size)
    if layout.padded_numel != record["padded_numel"] or layout.numel != record["numel"]:
        raise CheckpointError(f"{METADATA}: flat parameter {record['name']!r} is inconsistent (numel, padding).")
    return layout


def saved_range(layout: FlatParamLayout, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` in flat coordinates that ``rank``'s shard file holds: its shard without padding."""
    start, end = layout.shard_range(rank)
    return min(start, layout.numel), min(end, layout.numel)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read as JSON ({err}).") from None


def _describe_missing(path: Path) -> str:
    if not path.exists():
        unfinished = [p.name for p in unfinished_saves(path)]
        return f"no checkpoint at {path}" + (
            f" (an unfinished save left {', '.join(unfinished)})" if unfinished else ""
        )
    if not path.is_dir():
        return f"{path} is a file, not a sharded checkpoint directory"
    return (
        f"{path} is an incomplete checkpoint: it has no {COMPLETE} marker, which is written last, so the save"
        " that wrote it did not finish (or it is not a shardlab checkpoint)"
    )


class CheckpointReader:
    """A complete sharded checkpoint: its metadata, verification, and reads of any element range."""

    REQUIRED = (
        "world_size",
        "stage",
        "precision",
        "broadcast_buffers",
        "module",
        "state_dict_keys",
        "flat_params",
        "optimizers",
        "rank_state",
        "files",
    )

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        missing = [k for k in self.REQUIRED if k not in meta]
        missing += [
            f"optimizers[{o}].{k}"
            for o, opt in enumerate(meta.get("optimizers", []))
            for k in ("params", "state_keys")
            if k not in opt
        ]
        if missing:
            raise KeyError(f"missing {', '.join(missing)}")
        self.world_size: int = meta["world_size"]
        self.layouts = [layout_from_record(r, self.world_size) for r in meta["flat_params"]]
        self.tensors: list[dict[str, str]] = [r["tensors"] for r in meta["flat_params"]]
        self.where: dict[str, tuple[int, ParamSlot]] = {
            fqn: (i, slot) for i, layout in enumerate(self.layouts) for slot in layout.slots for fqn in slot.fqns
        }
        self._loaded: dict[str, dict[str, Tensor]] = {}  # by file name

    @staticmethod
    def open(path: str | Path) -> CheckpointReader:
        """Read COMPLETE and metadata.json; raise ``CheckpointError`` unless the checkpoint is complete. ``path``:
        the checkpoint's model file, or its shard directory."""
        given, path = Path(path), sharded_path(path)
        if path != given and not path.is_dir():
            raise CheckpointError(
                f"{given} is a sharded checkpoint's model file, and the shard directory it names, {path}, is"
                " missing. HINT: a sharded checkpoint is that file and that directory: copy or move both (the"
                " file alone still loads the weights: MyModule.load_from_checkpoint)."
            )
        marker = path / COMPLETE
        if not marker.is_file():
            hint = (
                "check the path (a sharded checkpoint is a directory, a full one a file)"
                if not path.is_dir()
                else "load an earlier checkpoint; a save interrupted by a crash leaves the previous one of that name"
                " intact"
            )
            raise CheckpointError(f"{_describe_missing(path)}. HINT: {hint}.")
        complete = read_json(marker)
        if complete.get("format") != FORMAT or not isinstance(complete.get("version"), int):
            raise CheckpointError(f"{marker} is not a {FORMAT} marker. HINT: is {path} a shardlab checkpoint?")
        if complete["version"] > VERSION:
            raise CheckpointError(
                f"{path} has format version {complete['version']}; this lightning_shardlab reads"
                f" up to {VERSION}. HINT: upgrade lightning_shardlab."
            )
        check_file(path / METADATA, complete["metadata"])
        meta = read_json(path / METADATA)
        try:
            return CheckpointReader(path, meta)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path / METADATA} is malformed ({err!r}). HINT: was it edited by hand?") from None

    # ---- which files ----

    def shard_files(self) -> list[str]:
        return [shard_file(r, self.world_size) for r in range(self.world_size)]

    def rank_state_files(self) -> list[str]:
        return list(self.meta["rank_state"]["files"])

    def ranks_holding(self, fqn: str, a: int, b: int) -> set[int]:
        """Saved ranks whose shard files hold elements ``[a, b)`` of parameter ``fqn``."""
        i, slot = self.where[fqn]
        if b <= a:
            return set()
        s = self.layouts[i].shard_numel
        return set(range((slot.offset + a) // s, (slot.offset + b - 1) // s + 1))

    # ---- verification ----

    def verify(self, read: Iterable[str]) -> None:
        """Sizes of every file; sha256 and (for shard files) tensor names, dtypes and lengths of ``read``."""
        read = set(read)
        for name, record in sorted(self.meta["files"].items()):
            check_file(self.path / name, record, checksum=name in read)
        for rank in range(self.world_size):
            if shard_file(rank, self.world_size) in read:
                self._check_tensors(rank)

    def _check_tensors(self, rank: int) -> None:
        path = self.path / shard_file(rank, self.world_size)
        tensors = self._shard(rank)
        for layout, kinds in zip(self.layouts, self.tensors):
            lo, hi = saved_range(layout, rank)
            for kind, dtype in kinds.items():
                name = master_key(layout.name) if kind == "master" else f"{kind}/{layout.name}"
                t = tensors.get(name)
                if t is None or dtype_name(t.dtype) != dtype or t.dim() != 1 or t.numel() != hi - lo:
                    found = "nothing" if t is None else f"{dtype_name(t.dtype)} of shape {tuple(t.shape)}"
                    raise CheckpointError(
                        f"checkpoint file {path} holds {found} under {name!r}, expected {dtype} of {hi - lo}"
                        " elements. HINT: the checkpoint was damaged or mixed with another one's files."
                    )

    def _shard(self, rank: int) -> dict[str, Tensor]:
        return self._tensors(shard_file(rank, self.world_size))

    def owned(self, name: str) -> dict[str, Tensor]:
        """The tensors of owned file ``name`` (whole-tensor optimizers' state: checkpoint/owned_state.py)."""
        return self._tensors(name)

    def _tensors(self, name: str) -> dict[str, Tensor]:
        if name not in self._loaded:
            path = self.path / name
            try:
                self._loaded[name] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # noqa: BLE001  (any unreadable file is the same verdict)
                raise CheckpointError(f"checkpoint file {path} cannot be read ({err}). HINT: it is damaged.") from None
        return self._loaded[name]

    # ---- reading ----

    def read(self, kind: str, index: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        """Elements ``[lo, hi)`` (flat coordinates) of tensor ``kind`` of saved flat parameter ``index``. 1-D;
        written into ``out`` (1-D, ``hi - lo`` elements) when given."""
        layout = self.layouts[index]
        name = master_key(layout.name) if kind == "master" else f"{kind}/{layout.name}"
        parts = []
        for rank in range(lo // layout.shard_numel, (hi - 1) // layout.shard_numel + 1) if hi > lo else ():
            start, end = saved_range(layout, rank)
            a, b = max(lo, start), min(hi, end)
            if b > a:
                parts.append(self._shard(rank)[name][a - start : b - start])
        n = max(hi - lo, 0)
        out = torch.empty(n, dtype=parse_dtype(self.tensors[index][kind])) if out is None else out
        if sum(p.numel() for p in parts) != n or out.numel() != n:
            raise ValueError(f"{name}: [{lo}, {hi}) is not inside its {layout.numel} saved elements (or out has"
                             f" {out.numel()} elements): a reader's caller asked for what no shard holds")  # fmt: skip
        if parts:
            torch.cat(parts, out=out)  # a copy: the mapped pages can go
        for part in parts:
            drop_pages(part)  # so reading a whole checkpoint never holds it in memory
        return out

    def read_param(self, kind: str, fqn: str, a: int, b: int, out: Tensor | None = None) -> Tensor:
        """Elements ``[a, b)`` of parameter ``fqn`` (in its own flattened order) of tensor ``kind``. 1-D."""
        index, slot = self.where[fqn]
        return self.read(kind, index, slot.offset + a, slot.offset + b, out)

    def load_trainer_state(self, weights_only: bool | None) -> dict[str, Any]:
        return self._load_pickle(TRAINER_STATE, weights_only)

    def load_rank_states(self, weights_only: bool | None) -> list[dict[str, Any]]:
        return [self._load_pickle(name, weights_only) for name in self.rank_state_files()]

    def _load_pickle(self, name: str, weights_only: bool | None) -> Any:
        try:
            return torch.load(self.path / name, map_location="cpu", weights_only=weights_only)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(
                f"checkpoint file {self.path / name} cannot be loaded ({type(err).__name__}: {err}). HINT: if it"
                " holds your own classes and you trust it, load with weights_only=False."
            ) from None

    def close(self) -> None:
        self._loaded.clear()
