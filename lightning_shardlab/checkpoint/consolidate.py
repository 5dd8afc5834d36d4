"""``shardlab consolidate SRC DST``: a sharded checkpoint becomes one plain Lightning checkpoint, in one process.

The output is what ``state_dict_type="full"`` writes: ``state_dict`` with exactly the LightningModule's
own keys in its order (tied parameters share one tensor), ``optimizer_states`` in the unsharded torch
format (state by parameter index, per-element tensors in the parameters' shapes), and everything else
Lightning saved (loops, callbacks, LR schedulers, hyperparameters), and with ShardLabEMA the averaged
weights under ``ema_state_dict`` (the same keys). So ``MyModule.load_from_checkpoint(DST)``
loads it without importing this package, and shardlab loads it back at any world size and stage.

No process group and no original world size: this one process verifies every file (sizes, sha256),
then streams: each parameter and each optimizer state tensor is read from the memory-mapped shard files
(the pages handed back once read) into one staging buffer and written into DST on its own
(checkpoint/stream_save.py), so memory holds one tensor at a time, whatever the model's size. Non-model
state that differed between ranks is kept, every rank's value, under ``checkpoint["shardlab_rank_states"]``
(plain types; Lightning ignores the key). DST is written under a temporary name and renamed into place.
``consolidated_checkpoint`` builds the same dict in memory (tests, small models).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_shardlab.checkpoint.atomic import CheckpointError, commit, delete, fsync_file, new_id, tmp_path
from lightning_shardlab.checkpoint.fabric_state import full_parts, to_user_shape
from lightning_shardlab.checkpoint.format import (
    EMA,
    EMA_RECORD,
    EMA_STATE_DICT,
    RANK_STATES_KEY,
    CheckpointReader,
    parse_dtype,
)
from lightning_shardlab.checkpoint.owned_state import read_one
from lightning_shardlab.checkpoint.stream_save import Deferred, stream_save


def consolidated_checkpoint(
    src: str | Path, weights_only: bool | None = None, deferred: bool = False
) -> dict[str, Any]:
    """The full (plain Lightning) checkpoint of the sharded checkpoint ``src``; with ``deferred``, its tensors of
    parameters and optimizer state are ``Deferred`` (read when written). Raises ``CheckpointError``."""
    reader = CheckpointReader.open(src)
    reader.verify(reader.meta["files"])  # every file, checksums included
    checkpoint = reader.load_trainer_state(weights_only)
    saved = checkpoint.pop(RANK_STATES_KEY, None)
    if saved and saved["paths"]:
        values = [s["values"] for s in reader.load_rank_states(weights_only)]
        checkpoint[RANK_STATES_KEY] = {**saved, "values": values}
    ema = checkpoint.get(EMA_RECORD)
    if ema is not None:  # ShardLabEMA's average: the same keys, averaged buffers, frozen parameters as they are
        replicated = {**checkpoint["state_dict"], **ema["buffers"]}
        checkpoint[EMA_STATE_DICT] = _full_state_dict(reader, replicated, EMA, deferred)
    checkpoint["state_dict"] = _full_state_dict(reader, checkpoint["state_dict"], deferred=deferred)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [
            _full_optimizer_state(reader, o, s, deferred) for o, s in enumerate(checkpoint["optimizer_states"])
        ]
    if not deferred:
        reader.close()
    return to_user_shape(checkpoint)  # a Fabric checkpoint under the user's keys; a Trainer's as it is


def _full_state_dict(
    reader: CheckpointReader, replicated: dict[str, Any], kind: str = "master", deferred: bool = False
) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for i, layout in enumerate(reader.layouts):
        saved = kind if kind in reader.tensors[i] else "master"  # a frozen flat parameter has no average
        dtype = parse_dtype(reader.tensors[i][saved])
        flat = None if deferred else reader.read(saved, i, 0, layout.numel)  # 1-D, numel: unpadded
        for slot in layout.slots:
            a, b = slot.offset, slot.offset + slot.numel
            value = (
                Deferred(slot.shape, dtype, functools.partial(reader.read, saved, i, a, b))
                if flat is None
                else flat[a:b].view(slot.shape).clone()
            )
            for fqn in slot.fqns:  # tied names share one object: one tensor in the file
                params[fqn] = value
    keys = reader.meta["state_dict_keys"]
    missing = [k for k in keys if k not in params and k not in replicated]
    if missing:
        raise CheckpointError(f"{reader.path}: the saved state lacks {missing[:5]}. HINT: the checkpoint is damaged.")
    return {k: params[k] if k in params else replicated[k] for k in keys}


def _full_optimizer_state(
    reader: CheckpointReader, o: int, skeleton: dict[str, Any], deferred: bool = False
) -> dict[str, Any]:
    record = reader.meta["optimizers"][o]
    state: dict[int, dict[str, Any]] = {int(j): dict(v) for j, v in skeleton["state"].items()}
    for j, entry in enumerate(record.get("owned") or []):  # a whole-tensor optimizer's, as its owner held it
        for key, saved in (entry or {}).get("tensors", {}).items():
            read = functools.partial(read_one, reader, o, j, key)
            shape, dtype = torch.Size(saved["shape"]), parse_dtype(saved["dtype"])
            state.setdefault(j, {})[key] = Deferred(shape, dtype, read) if deferred else read()
    for j, keys in enumerate(record["state_keys"]):
        name = record["params"][j]
        index, slot = reader.where[name]
        for key in keys:
            read = functools.partial(reader.read_param, f"optim{o}/{key}", name, 0, slot.numel)
            dtype = parse_dtype(reader.tensors[index][f"optim{o}/{key}"])
            state.setdefault(j, {})[key] = Deferred(slot.shape, dtype, read) if deferred else read().view(slot.shape)
    return {"state": {j: state[j] for j in sorted(state)}, "param_groups": skeleton["param_groups"]}


def consolidate(src: str | Path, dst: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Write the consolidated checkpoint of ``src`` to ``dst`` atomically, one tensor at a time; returns what
    was written, read back memory-mapped (no copy in memory)."""
    checkpoint = consolidated_checkpoint(src, weights_only, deferred=True)
    final = Path(dst).absolute()
    if final == Path(src).absolute():
        raise ValueError(f"DST {dst} is the sharded checkpoint itself. HINT: write the consolidated file elsewhere.")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(final, new_id())
    try:
        stream_save(checkpoint, tmp)
        fsync_file(tmp)
        commit(tmp, final)
    finally:
        delete(tmp)
    return torch.load(final, map_location="cpu", mmap=True, weights_only=weights_only)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="shardlab consolidate",
        description="Turn a sharded shardlab checkpoint (a directory) into one plain Lightning checkpoint file,"
        " loadable with MyModule.load_from_checkpoint() without lightning_shardlab. One process.",
    )
    parser.add_argument("src", help="the sharded checkpoint directory")
    parser.add_argument("dst", help="the file to write (replaced atomically if it exists)")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load trainer_state.pt with weights_only=False (it holds your own classes; trust it)",
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = consolidate(args.src, args.dst, weights_only=False if args.trust_pickle else None)
    except (CheckpointError, ValueError, OSError) as err:
        sys.exit(f"shardlab consolidate: error: {err}")
    state_dict, optimizers = full_parts(checkpoint)  # a Trainer's or a Fabric's (the user's keys)
    n = sum(v.numel() for v in {id(v): v for v in state_dict.values() if torch.is_tensor(v)}.values())
    print(
        f"consolidated {args.src} -> {args.dst}: {len(state_dict)} state_dict entries ({n:,} elements),"
        f" {len(optimizers)} optimizer state(s), {Path(args.dst).stat().st_size:,} bytes"
    )


if __name__ == "__main__":
    main()
