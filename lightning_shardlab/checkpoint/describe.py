"""``shardlab inspect CKPT``: what a checkpoint holds and where each parameter lives. Reads; never writes.

For a sharded checkpoint (a directory): complete or not, the world size, stage and precision it was
saved with, the bytes each rank wrote, the units and their flat parameters, the optimizers' state keys,
any per-rank side state, and for every parameter its shape, flat parameter, offset and the element
range each rank holds. ``--verify`` also checks every file's size and sha256 (as loading does);
``--json`` prints the same as JSON. For a full checkpoint (one file): its entries and shapes.
The exit status is 1 when the checkpoint is incomplete or fails verification.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.dcp_describe import describe_dcp, render_dcp
from lightning_shardlab.checkpoint.dcp_read import is_dcp, not_asked
from lightning_shardlab.checkpoint.fabric_state import full_parts
from lightning_shardlab.checkpoint.format import (
    COMPLETE,
    METADATA,
    RANK_STATES_KEY,
    CheckpointReader,
    read_json,
    saved_range,
    shards_of,
    unfinished_saves,
)
from lightning_shardlab.checkpoint.owned_state import keys_of
from lightning_shardlab.core.display import size


def describe(path: str | Path, verify: bool = False) -> dict[str, Any]:
    """Everything ``shardlab inspect`` prints, as plain data."""
    path = Path(path)
    shards = shards_of(path)
    if shards is not None:  # a sharded checkpoint's model file: what it holds is described by its shards
        return {**describe(shards, verify), "model_file": str(path)}
    if path.is_file():
        return _describe_full(path)
    info: dict[str, Any] = {"path": str(path), "kind": "sharded", "problems": []}
    if not (path / COMPLETE).is_file():
        info["problems"].append(
            f"incomplete: no {COMPLETE} marker (the save did not finish)"
            if path.is_dir()
            else f"no checkpoint at {path}"
        )
        info["present"] = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        info["unfinished_saves"] = [p.name for p in unfinished_saves(path)]
        if not (path / METADATA).is_file():
            return info
        reader = CheckpointReader(path, read_json(path / METADATA))  # unverified, for the layout
    else:
        try:
            reader = CheckpointReader.open(path)
            if verify:
                reader.verify(reader.meta["files"])
                info["verified"] = True
        except CheckpointError as err:
            info["problems"].append(str(err))
            if not (path / METADATA).is_file():
                return info
            reader = CheckpointReader(path, read_json(path / METADATA))
    info.update(_layout(reader))
    return info


def _layout(reader: CheckpointReader) -> dict[str, Any]:
    meta, world = reader.meta, reader.world_size
    ranks = []
    for r in range(world):
        names = [n for n in meta["files"] if n.endswith(f"-{r:05d}-of-{world:05d}.pt")]
        ranks.append({"rank": r, "bytes": sum(meta["files"][n]["bytes"] for n in names), "files": names})
    units: dict[str, list[dict[str, Any]]] = {}
    params = []
    for layout, kinds in zip(reader.layouts, reader.tensors):
        units.setdefault(layout.unit, []).append(
            {
                "flat_param": layout.name,
                "numel": layout.numel,
                "padding": layout.padding,
                "params": len(layout.slots),
                "tensors": sorted(kinds),
            }
        )
        for slot in layout.slots:
            held = []
            for r in range(world):
                lo, hi = saved_range(layout, r)
                a, b = max(lo, slot.offset) - slot.offset, min(hi, slot.offset + slot.numel) - slot.offset
                if b > a:
                    held.append([r, a, b])
            params.append(
                {
                    "name": slot.name,
                    "aliases": list(slot.fqns[1:]),
                    "shape": list(slot.shape),
                    "dtype": str(layout.dtype).removeprefix("torch."),
                    "unit": layout.unit,
                    "flat_param": layout.name,
                    "offset": slot.offset,
                    "ranks": held,
                }
            )
    return {
        "format_version": meta["version"],
        "world_size": world,
        "replicas": meta.get("replicas", 1),  # hybrid sharding: shard groups that held these shards
        "stage": meta["stage"],
        "precision": meta["precision"],
        "module": meta["module"],
        "bytes": sum(f["bytes"] for f in meta["files"].values()),
        "files": len(meta["files"]),
        "per_rank": ranks,
        "units": units,
        "parameters": params,
        "optimizers": [
            {
                "params": len(o["params"]),
                "state_keys": sorted({k for ks in o["state_keys"] for k in ks}),
                "owned_keys": keys_of(o),
            }
            for o in meta["optimizers"]
        ],
        "rank_state": meta["rank_state"]["paths"],
    }


def _describe_full(path: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"path": str(path), "kind": "full", "problems": [], "bytes": path.stat().st_size}
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001
        info["problems"].append(f"cannot be read with weights_only=True: {type(err).__name__}: {err}")
        return info
    try:
        state, optimizers = full_parts(checkpoint)  # a Trainer's file or a Fabric's (the user's keys)
    except ValueError as err:
        info["problems"].append(str(err))
        return info
    info["entries"] = [
        {"name": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        for k, v in state.items()
        if torch.is_tensor(v)
    ]
    info.update({k: checkpoint[k] for k in ("epoch", "global_step") if k in checkpoint})
    info["optimizers"] = len(optimizers)
    info["rank_state"] = [repr(p) for p in checkpoint.get(RANK_STATES_KEY, {}).get("paths", [])]
    return info


def render(info: dict[str, Any]) -> str:
    lines = [f"{info['path']}: {info['kind']} checkpoint"]
    if "model_file" in info:
        lines.append(f"  the shards of the model file {info['model_file']} (torch.load reads it: the whole state dict)")
    lines += [f"  PROBLEM: {p}" for p in info["problems"]]
    if info["kind"] == "full":
        lines.append(
            f"  {size(info['bytes'])}, {len(info.get('entries', []))} tensors in state_dict,"
            f" {info.get('optimizers', 0)} optimizer state(s)"
        )
        lines += [f"    {e['name']:40s} {tuple(e['shape'])!s:16s} {e['dtype']}" for e in info.get("entries", [])]
        return "\n".join(lines)
    if "world_size" not in info:
        lines.append(f"  present: {', '.join(info.get('present', [])) or 'nothing'}")
        return "\n".join(lines)
    status = (
        "verified (sizes and sha256 of every file)"
        if info.get("verified")
        else "NOT loadable"
        if info["problems"]
        else "complete"
    )
    lines.append(
        f"  {status}; saved at world size {info['world_size']}"
        + (f" (x {info['replicas']} replica groups)" if info.get("replicas", 1) > 1 else "")
        + f", stage {info['stage']}, precision"
        f" {info['precision']}, module {info['module']}; {info['files']} data files, {size(info['bytes'])}"
        " (besides metadata.json and COMPLETE)"
    )
    lines.append("  per rank:")
    lines += [f"    rank {r['rank']:<4d} {size(r['bytes']):>12s}  {', '.join(r['files'])}" for r in info["per_rank"]]
    lines.append("  units:")
    for unit, fps in info["units"].items():
        for fp in fps:
            lines.append(
                f"    {unit:20s} {fp['flat_param']:32s} {fp['numel']:>12,} elements (+{fp['padding']} padding),"
                f" {fp['params']} parameters; {', '.join(fp['tensors'])}"
            )
    for o, opt in enumerate(info["optimizers"]):
        keys = ", ".join(opt["state_keys"]) or "none"
        owned = opt.get("owned_keys")
        held = f", whole on each parameter's owner: {', '.join(owned)}" if owned else ""
        lines.append(f"  optimizer {o}: {opt['params']} parameters, per-element state {keys}{held}")
    if info["rank_state"]:
        lines.append("  per-rank side state (each rank's value kept): " + "; ".join(info["rank_state"]))
    lines.append("  parameters (rank r holds elements [a, b) of the parameter, flattened):")
    for p in info["parameters"]:
        name = p["name"] + (f" (= {', '.join(p['aliases'])})" if p["aliases"] else "")
        where = "  ".join(f"rank {r} [{a}, {b})" for r, a, b in p["ranks"])
        lines.append(f"    {name:40s} {tuple(p['shape'])!s:14s} {p['flat_param']} @{p['offset']:<8d} {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="shardlab inspect", description="Describe a shardlab checkpoint: layout, ranks, bytes, parameters."
    )
    parser.add_argument("ckpt", help="a checkpoint: a sharded one (its path, or its shard directory) or a full file")
    parser.add_argument("--verify", action="store_true", help="check every file's size and sha256, as loading does")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--format",
        choices=("shardlab", "dcp"),
        default="shardlab",
        help="dcp: CKPT is a torch Distributed Checkpoint directory (its .metadata is a pickle: read only when asked)",
    )
    args = parser.parse_args(argv)
    if args.format == "dcp":
        info = describe_dcp(args.ckpt)
        text = render_dcp
    elif is_dcp(args.ckpt):  # by its file names: its pickle is not opened
        info, text = {"path": args.ckpt, "kind": "dcp", "problems": [not_asked(args.ckpt)]}, render_dcp
    else:
        info, text = describe(args.ckpt, verify=args.verify), render
    print(json.dumps(info, indent=1) if args.json else text(info))
    if info["problems"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
