"""The model file: what a sharded checkpoint's own path holds, so that Lightning and torch read it as a checkpoint.

[Note: the model file]

A sharded save to ``<name>`` (e.g. ``epoch=1-step=8.ckpt``) writes two things::

    <name>                  a torch file (``torch.load`` reads it): Lightning's checkpoint dict, but for
                            ``optimizer_states``, with ``state_dict`` the module's whole state dict (parameters in
                            master precision, as ``state_dict_type="full"`` writes them) and, with ShardLabEMA,
                            ``ema_state_dict``; a record ``shardlab.json`` names the shard directory
    <name>.shards-<id>/     the shards ([Note: the sharded checkpoint format] in checkpoint/format.py): what a
                            resume reads, at any world size and stage, optimizer state included

So ``MyModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` works in a plain process, with
no process group and nothing from this package, ``map_location`` and ``strict`` meaning what Lightning says.

No rank gathers the model. Rank 0 writes the file with a *hole* where each parameter's bytes go
(``save_with_holes``: the pickled dict, the buffers and every small tensor, and for each parameter a record of
its size left unwritten, a sparse region) and tells every rank where each parameter's bytes start (one
broadcast). Each rank of the first shard group then writes, with ``pwrite``, the elements of its own master
shard into the parameters they belong to (the flat coordinates [r*S, (r+1)*S) cut along the parameters'
boundaries), from the same tensors its shard file is written from, and flushes them (fsync). The file is
renamed into place last, after the shard directory is complete, so the path is the commit point of the
whole checkpoint: a save killed at any moment leaves the previous ``<name>`` and the shards it names.

Costs: the parameters are on disk twice (in the model file, and as the master shards the resume reads), so a
checkpoint of fp32 weights with Adam grows from 3x to 4x the model; each rank writes 1/N of the model more.
Limits: the file's records carry no CRC-32 (torch does not check it on load; the shards, which a resume reads,
carry sha256 sums); ``optimizer_states`` is absent, so resuming the file with another strategy fails with
Lightning's "checkpoint contains only the model" (resume with shardlab, or ``shardlab consolidate`` it into one
plain file that holds the optimizer state too); copying the checkpoint means copying both paths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shardlab.checkpoint.format import EMA, EMA_STATE_DICT, MODEL_RECORD, master_key, saved_range
from lightning_shardlab.checkpoint.stream_save import Deferred, save_with_holes
from lightning_shardlab.sharding.placeholders import placeholders_allowed
from lightning_shardlab.sharding.sharded_model import ShardedModel

MODEL_FORMAT = "shardlab-model-file"
MODEL_VERSION = 1
SHARDS_KEY = "shardlab_shards"  # in the file's dict: the shard directory's name (for whoever reads it by hand)

# (kind: "master" | "ema", flat parameter index, slot index) -> the byte offset of that parameter in the file
Offsets = dict[tuple[str, int, int], int]


def shards_name(final: Path, save_id: str) -> str:
    return f"{final.name}.shards-{save_id}"


def write_skeleton(
    path: Path,
    checkpoint: dict[str, Any],
    sharded: ShardedModel,
    shards: str,
    reshape: Callable[[dict[str, Any]], dict[str, Any]],
) -> Offsets:
    """Rank 0: the model file with a hole for every parameter (``checkpoint``: Lightning's dump with the module's
    replicated entries as ``state_dict``); returns where each parameter's bytes go."""
    holes: dict[tuple[str, int, int], Deferred] = {}
    with placeholders_allowed():
        keyed = sharded.module.state_dict(keep_vars=True)
    by_param = {}  # id(original parameter) -> (flat parameter index, slot index)
    for f, fp in enumerate(sharded.flat_params):
        for s, (slot, param) in enumerate(zip(fp.layout.slots, fp.params)):
            by_param[id(param)] = (f, s)
            holes["master", f, s] = Deferred(slot.shape, fp.master.dtype, None)
    replicated = checkpoint.get("state_dict", {})

    def entry(kind: str, key: str, value: Any) -> Any:  # a parameter's hole (tied names share one), else the value
        if id(value) not in by_param:
            return replicated[key]
        f, s = by_param[id(value)]
        return holes.get((kind, f, s), holes["master", f, s])

    content = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    content["state_dict"] = {k: entry("master", k, v) for k, v in keyed.items()}
    averages = sharded.averages
    if averages is not None:  # the average of each trainable flat parameter; a frozen one is its own average
        for f, avg in enumerate(averages.shards):
            if avg is not None:
                for s, slot in enumerate(sharded.flat_params[f].layout.slots):
                    holes[EMA, f, s] = Deferred(slot.shape, avg.dtype, None)
        replicated = {**replicated, **averages.buffers}
        content[EMA_STATE_DICT] = {k: entry(EMA, k, v) for k, v in keyed.items()}
    content[SHARDS_KEY] = shards
    record = json.dumps({"format": MODEL_FORMAT, "version": MODEL_VERSION, "shards": shards}).encode()
    where = save_with_holes(reshape(content), path, {MODEL_RECORD: record})
    return {key: where[id(hole)] for key, hole in holes.items() if id(hole) in where}


def write_slices(path: Path, offsets: Offsets, tensors: dict[str, Tensor], sharded: ShardedModel) -> None:
    """This rank's elements of every parameter (and of its average), written in place into the model file at
    ``path`` from its shard file's tensors, and flushed to disk. Only the first shard group writes (hybrid)."""
    if sharded.mesh.replica.rank != 0:
        return
    rank = sharded.mesh.shard.rank
    fd = os.open(path, os.O_WRONLY)
    try:
        for f, fp in enumerate(sharded.flat_params):
            lo, hi = saved_range(fp.layout, rank)  # what this rank's shard holds, in flat coordinates
            for kind in ("master", EMA):
                values = tensors.get(master_key(fp.layout.name) if kind == "master" else f"{EMA}/{fp.layout.name}")
                for s, slot in enumerate(fp.layout.slots):
                    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if values is None or b <= a or (kind, f, s) not in offsets:
                        continue
                    part = values[a - lo : b - lo].contiguous()
                    _pwrite(fd, part, offsets[kind, f, s] + (a - slot.offset) * part.element_size())
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite(fd: int, values: Tensor, offset: int) -> None:
    view = memoryview(values.detach().cpu().view(-1).view(dtype=torch.uint8).numpy()).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
