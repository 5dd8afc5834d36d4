"""Each rank's peak memory while saving and loading a torch Distributed Checkpoint, against its own shard.

    python -m benchmarks.dcp_memory                                   # 24 blocks of width 1024: the ~600 MB checkpoint
    python -m benchmarks.dcp_memory --depth 2 --out /tmp/dcp_smoke.md # a smoke run

2 CPU ranks, one thread each (gloo), fp32 AdamW, stage 3: the model of the streaming tests (blocks of two
``width x width`` linear layers; depth 24 at width 1024 is 50.4M parameters, a checkpoint of masters and two moments
of ~605 MB) trains one step and saves with ``state_dict_type="dcp"``, then a fresh world of 2 ranks (the same
layout) and of 4 ranks (each rank's shard cut elsewhere: DCP's reads reshard) resumes it. The default format
(``"sharded"``) runs beside it as the peer, in the same invocation.

Memory is each rank's resident set (``/proc/self/statm``), sampled every 2 ms by a thread while the save runs
(``trainer.save_checkpoint``), and while the load runs (from the strategy's ``load_checkpoint`` to the end of its
``load_optimizer_state_dict``); the figure is the peak over that window minus the resident set at its start. The
shard is what the rank holds of the checkpoint: its master elements and its per-element optimizer state (AdamW's
two moments), in bytes. The sharded format reads through ``mmap``: the pages it touches count as resident while
mapped (the kernel can drop them: they are the file's), where DCP's reader copies each saved chunk into anonymous
memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.ranks import run_ranks, save_report

SAVE_WORLD, LOAD_WORLDS = 2, (2, 4)
FORMATS = ("sharded", "dcp")
PAGE = os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak resident set above the one at ``start``, sampled by a thread until ``stop``."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._running = False

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def start(self) -> None:
        self.base = self.peak = self.now()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self.now())
        return self.peak - self.base


def _model(width: int, depth: int) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(7, width)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(depth)
            )
            self.out = nn.Linear(width, 3)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return F.mse_loss(self.out(h), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Blocks()


def _trainer(fmt: str, world: int, max_steps: int) -> Any:
    import lightning as L

    from lightning_shardlab import ShardLabStrategy

    return L.Trainer(
        accelerator="cpu", devices=world, strategy=ShardLabStrategy(stage=3, state_dict_type=fmt), max_steps=max_steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip


def _data() -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 7, generator=g), torch.randn(16, 3, generator=g)), batch_size=2)


def _shard_bytes(trainer: Any) -> int:
    """This rank's master elements and per-element optimizer state, in bytes."""
    sharded = trainer.strategy.sharded
    masters = sum(fp.master.numel() * fp.master.element_size() for fp in sharded.flat_params)
    state = trainer.optimizers[0].state_dict()["state"]
    moments = sum(v.numel() * v.element_size() for s in state.values() for k, v in s.items() if k != "step")
    return masters + moments


def save_rank(fmt: str, path: str, width: int, depth: int) -> dict:
    trainer = _trainer(fmt, SAVE_WORLD, max_steps=1)
    trainer.fit(_model(width, depth), _data())
    rss, started = PeakRss(), time.perf_counter()
    rss.start()
    trainer.save_checkpoint(path)
    growth, seconds = rss.stop(), time.perf_counter() - started
    return {"growth": growth, "shard": _shard_bytes(trainer), "seconds": seconds}


def load_rank(fmt: str, path: str, width: int, depth: int) -> dict:
    from lightning_shardlab.checkpoint import save_load

    rss, window = PeakRss(), {}
    load, load_optimizers = save_load.load, save_load.load_optimizers

    def measured_load(*args: Any, **kwargs: Any) -> Any:
        window["started"] = time.perf_counter()
        rss.start()
        return load(*args, **kwargs)

    def measured_optimizers(*args: Any, **kwargs: Any) -> Any:
        out = load_optimizers(*args, **kwargs)
        window["growth"], window["seconds"] = rss.stop(), time.perf_counter() - window["started"]
        return out

    save_load.load, save_load.load_optimizers = measured_load, measured_optimizers
    try:
        trainer = _trainer(fmt, int(os.environ["WORLD_SIZE"]), max_steps=2)  # one step after the resume
        trainer.fit(_model(width, depth), _data(), ckpt_path=path)
    finally:
        save_load.load, save_load.load_optimizers = load, load_optimizers
    return {"growth": window["growth"], "shard": _shard_bytes(trainer), "seconds": window["seconds"]}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _checkpoint_bytes(fmt: str, path: Path) -> int:
    if fmt == "dcp":
        return _size(path)
    return _size(path) + sum(_size(p) for p in path.parent.glob(f"{path.name}.shards-*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--out", default="benchmarks/DCP_MEMORY.md")
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardlab-dcp-") as tmp:
        for fmt in FORMATS:
            path = Path(tmp) / f"{fmt}.ckpt"
            runs = {"save 2": run_ranks(save_rank, SAVE_WORLD, {"fmt": fmt, "path": str(path), **_shape(args)})}
            size = _checkpoint_bytes(fmt, path)
            for world in LOAD_WORLDS:
                runs[f"load {world}"] = run_ranks(load_rank, world, {"fmt": fmt, "path": str(path), **_shape(args)})
            for what, ranks in runs.items():
                samples[f"{fmt} {what}"] = ranks
                rows.append(_row(fmt, what, ranks, size))
    text = "\n".join(
        [
            "# DCP checkpoints: each rank's peak memory while saving and loading",
            "",
            f"Command: `python -m benchmarks.dcp_memory --width {args.width} --depth {args.depth} --out {args.out}`",
            "",
            f"Machine: {machine()}. fp32 AdamW, stage 3; saved by 2 ranks, loaded by 2 and by 4 (1 thread each, gloo).",
            "Growth: the peak resident set during the save (or the load) minus the one at its start, per rank;",
            "shard: the bytes of the checkpoint that rank holds (master elements and AdamW's moments).",
            "",
            "| format | what | checkpoint | shard (max rank) | peak growth (max rank) | growth / shard | s (max) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    save_report(args.out, samples, text)


def _shape(args: argparse.Namespace) -> dict:
    return {"width": args.width, "depth": args.depth}


def _row(fmt: str, what: str, ranks: list[dict], size: int) -> str:
    shard, growth = max(r["shard"] for r in ranks), max(r["growth"] for r in ranks)
    seconds = max(r["seconds"] for r in ranks)
    mb = 1e6
    spread = statistics.pstdev([r["growth"] for r in ranks]) / mb
    return (
        f"| {fmt} | {what} | {size / mb:,.1f} MB | {shard / mb:,.1f} MB | {growth / mb:,.1f} MB (sd {spread:,.1f})"
        f" | {growth / shard:.2f} | {seconds:.2f} |"
    )


if __name__ == "__main__":
    main()
