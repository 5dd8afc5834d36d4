"""Seconds per step of the same GPT under shardlab stages 1-3 and its peers, interleaved in one invocation.

    python -m benchmarks.bench                       # the ~14M GPT (6 layers, width 384, 128 tokens, batch 8/rank)
    python -m benchmarks.bench --setting tiny        # 2 layers, width 64: per-call latency dominates
    python -m benchmarks.bench --setting both --repeats 5

Peers, all on 2 CPU ranks with one thread each (gloo), fp32 AdamW, the same model, data and init:
Lightning's ``ddp``, torch's own FSDP2 (``fully_shard`` on every block and the root, in a plain torch
loop), and a single process (one rank's batch, no communication). Every shardlab variant runs its defaults;
by default consecutive blocks under 1M parameters are merged into buckets (``unit_bucket_params``), so the
tiny model's two blocks are one unit; ``shardlab_stage_3_per_block`` is stage 3 with ``unit_bucket_params=0``,
a unit per block (the default before buckets; the same as plain stage 3 where blocks are larger, the default
setting). Each repeat runs every variant once,
in turn, in fresh processes; a sample is the median of the timed steps after warm-up. We report the
median and min-max over repeats, the ratios against the peers, peak memory per rank, and bytes moved
per step against theory. Results go to benchmarks/RESULTS.md and benchmarks/results.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.ranks import run_ranks, timing_trainer
from benchmarks.sections import kept_sections, snippet_markers

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "default": {"vocab_size": 8192, "n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 128, "batch": 8},
    "tiny": {"vocab_size": 256, "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 128, "batch": 8},
}
VARIANTS = (
    "single",
    "ddp",
    "fsdp2",
    "shardlab_stage_1",
    "shardlab_stage_2",
    "shardlab_stage_3",
    "shardlab_stage_3_per_block",
)


def _model(setting: dict):  # noqa: ANN202
    from lightning_shardlab.examples.gpt import GPT

    torch.manual_seed(0)
    keys = ("vocab_size", "n_layer", "n_embd", "n_head", "block_size")
    return GPT(**{k: setting[k] for k in keys}, lr=1e-4, warmup_steps=0)


def _tokens(setting: dict, steps: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(
        0, setting["vocab_size"], (steps * setting["batch"] * world, setting["block_size"] + 1), generator=g
    )


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_lightning(variant: str, setting_name: str, warmup: int, steps: int) -> dict:
    """One rank of a Lightning run (single, ddp, shardlab stage k): per-step seconds after warm-up."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabStrategy

    setting = SETTINGS[setting_name]
    world = int(os.environ["WORLD_SIZE"])
    strategy = variant
    if variant.startswith("shardlab"):
        options = {"unit_bucket_params": 0} if variant.endswith("per_block") else {}  # else: the defaults
        strategy = ShardLabStrategy(stage=int(variant.split("_")[2]), **options)
    if variant == "single":
        strategy = "auto"
    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            times.append(time.perf_counter() - self.t)

    tokens = _tokens(setting, warmup + steps, world)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    trainer = timing_trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=warmup + steps,
        callbacks=[Clock()],
    )
    model = _model(setting)
    trainer.fit(model, loader)
    moved = None
    if variant.startswith("shardlab"):
        ledger = trainer.strategy.sharded.comm.ledger
        moved = sum(t.bytes for k, t in ledger.by_kind.items() if k in ("all_gather", "reduce_scatter"))
        moved /= warmup + steps
    return {
        "times": times[warmup:],
        "peak_rss": _peak_rss(),
        "bytes_per_step": moved,
        "params": sum(p.numel() for p in model.parameters()),
    }


def run_fsdp2(setting_name: str, warmup: int, steps: int) -> dict:
    """One rank of torch's own FSDP2 in a plain loop: fully_shard on each block, then the root."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    setting = SETTINGS[setting_name]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    moved: Counter = Counter()
    originals = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "reduce_scatter_tensor")}

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def call(out, inp, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            full = out if name == "all_gather_into_tensor" else inp
            moved[name] += full.numel() * full.element_size()
            return fn(out, inp, *a, **k)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    mesh = init_device_mesh("cpu", (world,))
    model = _model(setting)
    params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = _tokens(setting, warmup + steps, world)[rank::world]
    times = []
    for i in range(warmup + steps):
        batch = tokens[i * setting["batch"] : (i + 1) * setting["batch"]]
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "times": times[warmup:],
        "peak_rss": _peak_rss(),
        "bytes_per_step": sum(moved.values()) / (warmup + steps),
        "params": params,
    }


def sample(variant: str, setting: str, warmup: int, steps: int) -> dict:
    world = 1 if variant == "single" else 2
    if variant == "fsdp2":
        ranks = run_ranks(run_fsdp2, world, {"setting_name": setting, "warmup": warmup, "steps": steps})
    else:
        ranks = run_ranks(
            run_lightning, world, {"variant": variant, "setting_name": setting, "warmup": warmup, "steps": steps}
        )
    return {
        "seconds": statistics.median(ranks[0]["times"]),
        "peak_rss": [r["peak_rss"] for r in ranks],
        "bytes_per_step": ranks[0]["bytes_per_step"],
        "params": ranks[0]["params"],
    }


def theory_bytes(variant: str, params: int) -> float | None:
    """Full-tensor bytes per step, fp32: stages 1-2 move 2 x 4P (reduce-scatter + all-gather), stage 3 3 x 4P."""
    if variant.startswith("shardlab_stage_"):
        return (3 if variant.startswith("shardlab_stage_3") else 2) * 4 * params
    if variant == "fsdp2":
        return 3 * 4 * params
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=("default", "tiny", "both"), default="both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", default=str(HERE))
    args = p.parse_args(argv)
    settings = ["default", "tiny"] if args.setting == "both" else [args.setting]
    samples: dict[str, dict[str, list[dict]]] = {s: {v: [] for v in args.variants} for s in settings}
    for repeat in range(args.repeats):  # interleaved: every variant once per repeat
        for setting in settings:
            for variant in args.variants:
                result = sample(variant, setting, args.warmup, args.steps)
                samples[setting][variant].append(result)
                print(f"[repeat {repeat}] {setting:7s} {variant:17s} {result['seconds']:.4f} s/step", flush=True)
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(samples, indent=1))
    write_report(samples, args, out)


def _summary(runs: list[dict]) -> dict:
    secs = [r["seconds"] for r in runs]
    return {
        "median": statistics.median(secs),
        "min": min(secs),
        "max": max(secs),
        "peak_rss": max(max(r["peak_rss"]) for r in runs),
        "bytes": runs[0]["bytes_per_step"],
        "params": runs[0]["params"],
    }


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{os.cpu_count()} cores, {cpu}; Python {platform.python_version()}, torch {torch.__version__}"


def write_report(samples: dict, args: argparse.Namespace, out: Path) -> None:
    lines = [
        "# Benchmark results",
        "",
        f"Command: `python -m benchmarks.bench --setting {args.setting} --repeats "
        f"{args.repeats} --warmup {args.warmup} --steps {args.steps}`",
        "",
        f"Machine: {machine()}. 2 ranks, 1 thread each (gloo), fp32 AdamW; "
        f"{args.repeats} interleaved repeats; a sample is the median of {args.steps} steps after "
        f"{args.warmup} warm-up steps.",
        "",
    ]
    for setting, variants in samples.items():
        summary = {v: _summary(runs) for v, runs in variants.items() if runs}
        cfg = SETTINGS[setting]
        lines += [
            snippet_markers(setting)[0],  # the manual includes each setting's tables: docs/performance.md
            f"## {setting}: {next(iter(summary.values()))['params']:,} parameters, {cfg['n_layer']} layers, "
            f"width {cfg['n_embd']}, {cfg['block_size']} tokens, batch {cfg['batch']} per rank",
            "",
            "| variant | s/step median | min-max | vs ddp | vs fsdp2 | peak RSS per rank | bytes/step | theory |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for v, s in summary.items():
            ddp = summary.get("ddp", {}).get("median")
            fsdp = summary.get("fsdp2", {}).get("median")
            theory = theory_bytes(v, s["params"])
            lines.append(
                f"| {v} | {s['median']:.4f} | {s['min']:.4f}-{s['max']:.4f} | {s['median'] / ddp:.3f} |"
                if ddp
                else f"| {v} | {s['median']:.4f} | {s['min']:.4f}-{s['max']:.4f} | - |"
            )
            lines[-1] += f" {s['median'] / fsdp:.3f} |" if fsdp else " - |"
            lines[-1] += f" {s['peak_rss'] / 2**20:.0f} MiB |"
            lines[-1] += f" {s['bytes'] / 1e6:.2f} MB |" if s["bytes"] else " - |"
            lines[-1] += f" {theory / 1e6:.2f} MB ({s['bytes'] / theory:.3f}x) |" if theory and s["bytes"] else " - |"
        lines.append("")
        lines += targets(setting, summary)
        lines += [snippet_markers(setting)[1], ""]
    gpu = out / "GPU.md"
    lines += [
        "## GPU",
        "",
        gpu.read_text().split("\n", 2)[2]
        if gpu.exists()
        else "`python -m benchmarks.gpu` (world size 1 overhead, GPT-2 124M bf16-mixed MFU, ranks sharing a GPU) "
        "writes `benchmarks/GPU.md`; it has not been run yet: no GPU was available.",
        "",
    ]
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n" + kept_sections(out / "RESULTS.md"))
    plot(samples, out / "results.png")
    print("\n".join(lines))


# the targets: (setting, variant, peer, most allowed ratio of medians)
TARGETS = (
    ("default", "shardlab_stage_3", "fsdp2", 0.95),
    ("default", "shardlab_stage_3", "ddp", 1.03),
    ("default", "shardlab_stage_1", "ddp", 1.00),
    ("default", "shardlab_stage_2", "ddp", 1.00),
    ("tiny", "shardlab_stage_1", "ddp", 1.2),
    ("tiny", "shardlab_stage_2", "ddp", 1.2),
    ("tiny", "shardlab_stage_3", "ddp", 1.10),  # with default options: the small blocks in one bucket
)


def targets(setting: str, summary: dict) -> list[str]:
    """Each target of this setting against this run's medians, met or missed; memory and bytes too."""
    rows = []
    for where, variant, peer, most in TARGETS:
        if where == setting and variant in summary and peer in summary:
            ratio = summary[variant]["median"] / summary[peer]["median"]
            rows.append(
                f"| {variant} / {peer} seconds per step | <= {most:.2f} | {ratio:.3f} | "
                f"{'met' if ratio <= most else 'missed'} |"
            )
    for variant, s in summary.items():
        theory = theory_bytes(variant, s["params"])
        if theory and s["bytes"]:
            rows.append(
                f"| {variant} bytes per step / theory | <= 1.02 | {s['bytes'] / theory:.3f} | "
                f"{'met' if s['bytes'] / theory <= 1.02 else 'missed'} |"
            )
        if variant.startswith("shardlab") and "fsdp2" in summary:
            ratio = s["peak_rss"] / summary["fsdp2"]["peak_rss"]
            rows.append(
                f"| {variant} peak RSS / fsdp2's | <= 1.00 | {ratio:.3f} | {'met' if ratio <= 1 else 'missed'} |"
            )
    if not rows:
        return []
    return [f"Targets ({setting}):", "", "| target | allowed | this run | |", "| --- | --- | --- | --- |", *rows, ""]


def plot(samples: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(samples), figsize=(6 * len(samples), 4), squeeze=False)
    for ax, (setting, variants) in zip(axes[0], samples.items()):
        names = [v for v, runs in variants.items() if runs]
        stats = [_summary(variants[v]) for v in names]
        med = [s["median"] for s in stats]
        err = [[m - s["min"] for m, s in zip(med, stats)], [s["max"] - m for m, s in zip(med, stats)]]
        ax.bar(range(len(names)), med, yerr=err, capsize=4)
        ax.set_xticks(range(len(names)), [n.replace("shardlab_", "") for n in names], rotation=30)
        ax.set(title=f"{setting}: seconds per step (median, min-max)", ylabel="s/step")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


if __name__ == "__main__":
    main()
