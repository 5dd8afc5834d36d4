"""Disk offload against none: seconds per step, bytes read from and written to disk per step, memory.

    python -m benchmarks.offload                                    # the 14M GPT of benchmarks/bench.py
    python -m benchmarks.offload --setting tiny --repeats 1 --steps 2 --warmup 1 --out /tmp/offload_smoke.md

2 CPU ranks, one thread each (gloo), fp32 AdamW, the same GPT, data and init for every variant:
``shardlab_stage_3`` and ``shardlab_stage_2`` with ``offload='none'`` and with ``offload='disk'`` (files in
``--offload-dir``, default the system's temporary directory). Each repeat runs every variant once, in turn,
in fresh processes; a sample is rank 0's median of the timed steps after warm-up. Bytes read and written
per step are the process's storage I/O (``/proc/self/io``: page-cache misses read, pages dirtied) over the
timed steps, against the layout's figure: every offload file (optimizer state of each trainable shard;
in fp32 the master is the compute shard and stays) read once and written once per step, in whole pages.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench import SETTINGS, _model, _peak_rss, _summary, _tokens, machine
from benchmarks.ranks import interleaved, run_ranks, save_report, timing_trainer

WORLD = 2
VARIANTS = {
    "stage_3_none": {"stage": 3, "offload": "none"},
    "stage_3_disk": {"stage": 3, "offload": "disk"},
    "stage_2_none": {"stage": 2, "offload": "none"},
    "stage_2_disk": {"stage": 2, "offload": "disk"},
}


def _anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def run_rank(variant: str, setting_name: str, warmup: int, steps: int, offload_dir: str) -> dict:
    """One rank of one variant: its timed steps, storage I/O over them, memory, and the tier's layout."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabStrategy
    from lightning_shardlab.budget.measured.tiers import io_counters

    setting, times, io = SETTINGS[setting_name], [], {}

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:  # noqa: ANN001
            if batch_idx == warmup:
                io["start"] = io_counters()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
            times.append(time.perf_counter() - self.t)
            if batch_idx == warmup + steps - 1:
                io["end"], io["anon"] = io_counters(), _anon_bytes()

    tokens = _tokens(setting, warmup + steps, WORLD)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    strategy = ShardLabStrategy(**VARIANTS[variant], offload_dir=offload_dir)
    trainer = timing_trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=warmup + steps, callbacks=[Clock()]
    )
    model = _model(setting)
    trainer.fit(model, loader)
    offload = trainer.strategy.sharded.offload
    (read0, written0), (read1, written1) = io["start"], io["end"]
    return {
        "times": times[warmup:],
        "peak_rss": _peak_rss(),
        "anon": io["anon"],
        "params": sum(p.numel() for p in model.parameters()),
        "read": (read1 - read0) / steps,
        "written": (written1 - written0) / steps,
        "file_bytes": offload.files.nbytes if offload is not None else 0,
        "page_bytes": offload.files.page_bytes if offload is not None else 0,
    }


def sample(variant: str, setting: str, warmup: int, steps: int, offload_dir: str) -> dict:
    kwargs = {"variant": variant, "setting_name": setting, "warmup": warmup, "steps": steps, "offload_dir": offload_dir}
    ranks = run_ranks(run_rank, WORLD, kwargs)
    seconds, peaks = statistics.median(ranks[0]["times"]), [r["peak_rss"] for r in ranks]
    return {**ranks[0], "seconds": seconds, "peak_rss": peaks, "bytes_per_step": None}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def row(variant: str, runs: list[dict], peers: dict[str, float]) -> str:
    s, first = _summary(runs), runs[0]
    plain = peers.get(variant.replace("_disk", "_none"))
    pages = first["page_bytes"]
    cells = [
        variant,
        f"{s['median']:.4f}",
        f"{s['min']:.4f}-{s['max']:.4f}",
        f"{s['median'] / plain:.3f}" if plain else "-",
        f"{s['peak_rss'] / 2**20:.0f} MiB",
        f"{first['anon'] / 2**20:.0f} MiB",
        _mb(first["file_bytes"]),
        _mb(first["read"]),
        _mb(first["written"]),
        f"{first['read'] / pages:.3f} / {first['written'] / pages:.3f}" if pages else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def report(samples: dict[str, list[dict]], args: argparse.Namespace) -> str:
    cfg, runs = SETTINGS[args.setting], next(r for r in samples.values() if r)
    peers = {v: _summary(r)["median"] for v, r in samples.items() if r}
    return "\n".join(
        [
            "# Disk offload: seconds per step and bytes to and from disk",
            "",
            f"Command: `python -m benchmarks.offload --setting {args.setting} --repeats {args.repeats} --warmup "
            f"{args.warmup} --steps {args.steps} --out {args.out}`",
            "",
            f"Machine: {machine()}. {WORLD} ranks, 1 thread each (gloo), fp32 AdamW; {args.repeats} interleaved "
            f"repeats; a sample is rank 0's median of {args.steps} steps after {args.warmup} warm-up steps. "
            f"Offload files in {args.offload_dir or tempfile.gettempdir()}.",
            "",
            f"Model ({args.setting}): {runs[0]['params']:,} parameters, {cfg['n_layer']} layers, width "
            f"{cfg['n_embd']}, {cfg['block_size']} tokens, batch {cfg['batch']} per rank.",
            "",
            "| variant | s/step median | min-max | vs same stage, no offload | peak RSS (max over ranks) "
            "| RssAnon after the last step | offloaded (files) | read from disk per step | written per step "
            "| read / written vs the layout's pages |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *(row(v, r, peers) for v, r in samples.items() if r),
            "",
            "Read and written: rank 0's storage I/O per timed step (`/proc/self/io` read_bytes / write_bytes). "
            "The layout's figure is the offload files in whole pages: the optimizer state of each trainable "
            "shard (AdamW: 8 bytes per element; in fp32 the master is the compute shard and stays in memory), "
            "each page read once and written back once per step. A read below 1.000 is the page cache "
            "answering a read before the dropped pages were needed again (the kernel may keep them).",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=tuple(SETTINGS), default="default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--offload-dir", default=None, help="where the offload files go (default: the temp directory)")
    p.add_argument("--out", default="benchmarks/OFFLOAD.md")
    args = p.parse_args(argv)
    offload_dir = args.offload_dir or tempfile.gettempdir()
    samples = interleaved(
        VARIANTS, args.repeats, lambda v: sample(v, args.setting, args.warmup, args.steps, offload_dir)
    )
    save_report(args.out, samples, report(samples, args))


if __name__ == "__main__":
    main()
