"""What a torch Distributed Checkpoint (DCP) directory holds: ``shardlab inspect DCP_DIR --format dcp``.

One process, no process group. It unpickles ``.metadata`` (which is why it runs only with ``--format dcp``:
checkpoint/dcp_read.py) and reads no tensor: the files and their bytes, which ranks wrote them, the optimizers
(through their ``param_groups`` entries, as loading finds them), and every tensor's shape, dtype and chunks, with
the bytes each writer rank holds of it. ``meta.pt`` (Lightning's side file) is listed, not opened.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.dcp_load import model_keys, optimizer_records
from lightning_shardlab.checkpoint.dcp_read import META, DcpReader
from lightning_shardlab.core.display import size

WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")  # FileSystemWriter's data file of rank r


def describe_dcp(path: str | Path) -> dict[str, Any]:
    """Everything ``shardlab inspect --format dcp`` prints, as plain data."""
    path = Path(path)
    info: dict[str, Any] = {"path": str(path), "kind": "dcp", "problems": []}
    try:
        reader = DcpReader.open(path)
    except CheckpointError as err:
        info["problems"].append(str(err))
        return info
    files = sorted(p for p in path.iterdir() if p.is_file())
    info["files"] = [{"name": p.name, "bytes": p.stat().st_size} for p in files]
    info["meta"] = (path / META).is_file()
    per_rank: dict[int, int] = {}
    for p in files:
        m = WRITER.match(p.name)
        if m is not None:
            per_rank[int(m[1])] = per_rank.get(int(m[1]), 0) + p.stat().st_size
    info["per_rank"] = [{"rank": r, "bytes": b} for r, b in sorted(per_rank.items())]
    held: dict[str, dict[int, int]] = {}  # tensor -> writer rank -> bytes of its chunks in that rank's files
    for index, where in (reader.metadata.storage_data or {}).items():
        m = WRITER.match(where.relative_path)
        if m is not None:
            ranks = held.setdefault(index.fqn, {})
            ranks[int(m[1])] = ranks.get(int(m[1]), 0) + where.length
    info["tensors"] = [_tensor(key, md, held.get(key, {})) for key, md in reader.tensors.items()]
    records = optimizer_records(reader)
    info["model"] = model_keys(reader)
    info["optimizers"] = [
        {
            "prefix": prefix,
            "groups": len(groups),
            "state_keys": sorted({k.rpartition(".")[2] for k in reader.tensors if k.startswith(prefix + "state.")}),
        }
        for prefix, groups in records.items()
    ]
    info["objects"] = len(reader.objects)
    return info


def _tensor(key: str, md: Any, held: dict[int, int]) -> dict[str, Any]:
    """A tensor's shape, dtype and chunks; the bytes each writer rank's files hold of it."""
    return {
        "name": key,
        "shape": list(md.size),
        "dtype": str(md.properties.dtype).removeprefix("torch."),
        "chunks": len(md.chunks),
        "ranks": sorted(held.items()),
    }


def render_dcp(info: dict[str, Any]) -> str:
    lines = [f"{info['path']}: torch Distributed Checkpoint"]
    lines += [f"  PROBLEM: {p}" for p in info["problems"]]
    if "files" not in info:
        return "\n".join(lines)
    total = sum(f["bytes"] for f in info["files"])
    side = ", and meta.pt (Lightning's loops, schedulers, callbacks)" if info["meta"] else ", no meta.pt"
    lines.append(
        f"  {len(info['files'])} files, {size(total)}; written by {len(info['per_rank'])} rank(s){side};"
        f" {len(info['tensors'])} tensors ({len(info['model'])} model), {info['objects']} other entries"
    )
    lines.append("  per writer rank:")
    lines += [f"    rank {r['rank']:<4d} {size(r['bytes']):>12s}" for r in info["per_rank"]]
    if not info["optimizers"]:
        lines.append("  no optimizer state (no param_groups entry): loading it, the optimizers start fresh")
    for opt in info["optimizers"]:
        keys = ", ".join(opt["state_keys"]) or "none"
        lines.append(f"  optimizer {opt['prefix'] or '(top level)'}: {opt['groups']} param groups, state {keys}")
    lines.append("  tensors (chunks; bytes held by each writer rank):")
    for t in info["tensors"]:
        held = "  ".join(f"rank {r} {size(b)}" for r, b in t["ranks"])
        lines.append(f"    {t['name']:48s} {tuple(t['shape'])!s:14s} {t['dtype']:9s} {t['chunks']:>3d}  {held}")
    return "\n".join(lines)
