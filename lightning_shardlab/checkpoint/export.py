"""``shardlab export SRC DST``: a checkpoint becomes safetensors in the Hugging Face layout, one tensor at a time.

SRC is a sharded checkpoint (a directory) or a full one (a file). DST is a directory that
``transformers``' ``from_pretrained`` reads: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` once the weights pass ``--max-shard-size``; and ``config.json`` when the
checkpoint carries a Hugging Face config (``checkpoint["hf_config"]``: examples/hf_gpt2.py stores it).

Memory stays bounded whatever the model's size: the output shards are planned from the shapes alone, then
each parameter is read from the memory-mapped shard files (its slices, from every rank that holds one;
their pages handed back once read) and cast straight into its place in one staging buffer the size of the
largest output shard, which safetensors writes from; the buffer is reused for the next shard. Peak: one
output shard (or the largest parameter, when it is larger).

Keys: the module's own state-dict names in its order; ``--prefix lm.`` keeps only the keys under ``lm.``
(a LightningModule holding an HF model as ``self.lm``) and strips it. A tied parameter is written once,
under the first name its module registers (transformers' ``save_pretrained`` keeps the same one: for
GPT-2, ``transformer.wte.weight`` and not ``lm_head.weight``). Floating tensors are written in ``--dtype``
(default: as saved, the fp32 masters); others as they are.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from lightning_shardlab.checkpoint.atomic import CheckpointError, commit, delete, new_id, tmp_path
from lightning_shardlab.checkpoint.dcp_export import export_dcp
from lightning_shardlab.checkpoint.fabric_state import full_parts
from lightning_shardlab.checkpoint.format import CheckpointReader, shards_of
from lightning_shardlab.core.display import parse_size

HF_CONFIG_KEY = "hf_config"  # a LightningModule's on_save_checkpoint may store its HF config.to_dict() here
_ALIGN = 8  # bytes: each tensor's stretch of the staging buffer starts at a multiple of any element size
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its output key, shape, dtype as saved, and ``fill(out=...)``, which writes its values
    into ``out`` (1-D, in the output dtype)."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    fill: Callable[..., Any]

    def out_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return dtype if dtype is not None and self.dtype.is_floating_point else self.dtype

    def nbytes(self, dtype: torch.dtype | None) -> int:
        return self.shape.numel() * self.out_dtype(dtype).itemsize


def sharded_entries(reader: CheckpointReader, replicated: dict[str, Any], prefix: str) -> list[Entry]:
    """The module's state-dict entries under ``prefix``: parameters read from the shards (each tied parameter
    once), the rest (buffers) from the replicated state; in the module's state-dict order."""
    out, seen = [], set()
    for name in reader.meta["state_dict_keys"]:
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if name in reader.where:
            index, slot = reader.where[name]
            if slot.fqns[0] != name or slot.fqns[0] in seen:
                continue  # a tied parameter's second name
            seen.add(name)
            read = functools.partial(reader.read_param, "master", name, 0, slot.numel)
            out.append(Entry(key, slot.shape, reader.layouts[index].dtype, read))
        elif isinstance(replicated.get(name), Tensor):
            out.append(_held(key, replicated[name]))
    return out


def _held(key: str, value: Tensor) -> Entry:
    """An entry for a tensor already at hand (a buffer, or a full checkpoint's memory-mapped tensor)."""
    return Entry(key, value.shape, value.dtype, lambda out, value=value: out.copy_(value.reshape(-1)))


def full_entries(state_dict: dict[str, Any], prefix: str) -> list[Entry]:
    """The entries of a full checkpoint's (memory-mapped) state dict under ``prefix``; tied tensors once."""
    out, seen = [], set()
    for name, value in state_dict.items():
        if not name.startswith(prefix) or not isinstance(value, Tensor):
            continue
        ptr = (value.untyped_storage().data_ptr(), value.storage_offset())
        if ptr in seen:
            continue  # tied: the same storage under a second name
        seen.add(ptr)
        out.append(_held(name[len(prefix) :], value))
    return out


def plan_shards(entries: list[Entry], dtype: torch.dtype | None, max_bytes: float) -> list[list[Entry]]:
    """Consecutive entries in files of at most ``max_bytes`` each (an entry larger than that gets its own),
    as transformers shards a state dict."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = entry.nbytes(dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return [s for s in shards if s]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _tensors(shard: list[Entry], dtype: torch.dtype | None, staging: Tensor) -> Iterator[tuple[str, Tensor]]:
    """Each entry of ``shard`` filled into its own stretch of ``staging``, in the output dtype and its shape."""
    offset = 0
    for entry in shard:
        n = entry.nbytes(dtype)
        out = staging[offset : offset + n].view(entry.out_dtype(dtype))
        entry.fill(out=out)
        yield entry.key, out.view(entry.shape)
        offset += _aligned(n)


def write(entries: list[Entry], out: Path, dtype: torch.dtype | None, max_bytes: float) -> dict[str, Any]:
    """Write ``entries`` into ``out`` (a new directory) in the Hugging Face layout; returns what was written."""
    shards = plan_shards(entries, dtype, max_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map = {}
    staging = torch.empty(max(sum(_aligned(e.nbytes(dtype)) for e in shard) for shard in shards), dtype=torch.uint8)
    for shard, name in zip(shards, names):
        save_file(dict(_tensors(shard, dtype, staging)), str(out / name), metadata={"format": "pt"})
        weight_map.update({entry.key: name for entry in shard})
    total = sum(entry.nbytes(dtype) for entry in entries)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": names, "tensors": len(entries), "bytes": total}


def export(
    src: str | Path,
    dst: str | Path,
    prefix: str = "",
    dtype: str | None = None,
    max_shard_size: float = 5e9,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Export checkpoint ``src`` to the directory ``dst`` (written under a temporary name, then renamed).
    Raises ``CheckpointError`` or ``ValueError`` naming what is wrong."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    src, final = Path(src), Path(dst).absolute()
    if final.exists():
        raise ValueError(f"DST {dst} exists. HINT: export into a new directory (or remove it first).")
    if src.is_dir() or shards_of(src) is not None:
        reader = CheckpointReader.open(src)
        reader.verify(reader.shard_files())
        trainer_state = reader.load_trainer_state(weights_only)
        entries = sharded_entries(reader, trainer_state.get("state_dict", {}), prefix)
    else:
        try:
            trainer_state = torch.load(src, map_location="cpu", mmap=True, weights_only=weights_only)
        except Exception as err:  # noqa: BLE001  (a missing or damaged file is the same verdict)
            raise CheckpointError(f"{src} is not a readable checkpoint ({err}). HINT: check the path.") from None
        entries = full_entries(full_parts(trainer_state)[0], prefix)  # a Trainer's file or a Fabric's
    if not entries:
        raise ValueError(f"{src} holds no tensors under --prefix {prefix!r}. HINT: check the prefix (e.g. 'model.').")
    tmp = tmp_path(final, new_id())
    tmp.mkdir(parents=True)
    try:
        written = write(entries, tmp, DTYPES.get(dtype or ""), max_shard_size)
        config = trainer_state.get(HF_CONFIG_KEY)
        if config is not None:
            config = {**config, "torch_dtype": str(DTYPES[dtype] if dtype else torch.float32).removeprefix("torch.")}
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            written["files"].append("config.json")
        commit(tmp, final)
    finally:
        delete(tmp)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardlab export", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a sharded checkpoint directory or a full checkpoint file")
    parser.add_argument("dst", help="the directory to write (must not exist)")
    parser.add_argument("--prefix", default="", help="keep the keys under this prefix and strip it, e.g. 'model.'")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="floating tensors in this dtype (default: as saved)")
    parser.add_argument("--max-shard-size", type=parse_size, default=5e9, help="per file: 5GB (default), 500MB, ...")
    parser.add_argument("--trust-pickle", action="store_true", help="load trainer_state.pt with weights_only=False")
    parser.add_argument(
        "--format",
        choices=("safetensors", "dcp"),
        default="safetensors",
        help="dcp: a torch Distributed Checkpoint directory (weights, optimizer state by name; fully_shard loads it)",
    )
    args = parser.parse_args(argv)
    if args.format == "dcp":
        _export_dcp(args)
        return
    try:
        written = export(
            args.src, args.dst, args.prefix, args.dtype, args.max_shard_size, False if args.trust_pickle else None
        )
    except (CheckpointError, ValueError, OSError) as err:
        sys.exit(f"shardlab export: error: {err}")
    files = ", ".join(written["files"])
    print(f"exported {args.src} -> {args.dst}: {written['tensors']} tensors, {written['bytes']:,} bytes ({files})")


def _export_dcp(args: argparse.Namespace) -> None:
    if args.prefix or args.dtype:
        sys.exit(
            "shardlab export: error: --prefix and --dtype apply to safetensors. HINT: drop them with --format dcp."
        )
    try:
        written = export_dcp(args.src, args.dst, False if args.trust_pickle else None)
    except (CheckpointError, ValueError, OSError) as err:
        sys.exit(f"shardlab export: error: {err}")
    dropped = written["dropped_optimizers"]
    note = f"; {dropped} optimizer state(s) not written: a full file does not name their parameters" if dropped else ""
    print(
        f"exported {args.src} -> {args.dst} (torch Distributed Checkpoint): {written['tensors']} weights,"
        f" {written['optimizers']} optimizer state(s){note}"
    )


if __name__ == "__main__":
    main()
