"""Collectives that send fewer bytes, on an emulated slow link and on loopback: seconds per step against DDP.

    python -m benchmarks.fewer_bytes --link 1gbit        # 2 emulated nodes x 2 ranks, 1 Gb/s between nodes
    python -m benchmarks.fewer_bytes --link 10gbit
    python -m benchmarks.fewer_bytes --link loopback     # the same 4 ranks, no namespaces
    python -m benchmarks.fewer_bytes --table             # SLOW_LINKS.md and SLOW_LINKS.png from the three

One invocation per link (benchmarks/slow_link.py makes the link and always removes it), each writing
``SLOW_LINKS_<link>.json``. Every variant trains the same GPT on the same data and initial weights, fp32 AdamW, one
thread per rank (gloo): Lightning's ``ddp``, DDP with torch's own ``bf16_compress_hook``, shardlab stages 2 and 3
exact and with each fewer-bytes option (``reduce_dtype`` 'bf16' or 'int8', ``gather_dtype='int8'``, both), and
hybrid sharding with one shard group per node (``shard_group_size='node'``: gathers inside a node, one all-reduce of
each gradient shard across nodes). Each repeat runs every variant once in turn (one set of rank processes per
invocation: each variant a fit of its own in them); a sample is rank 0's median step after warm-up, with the
ledger's bytes per step by kind and wire dtype (shardlab variants). Speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.bench import _model, _peak_rss, _tokens, machine
from benchmarks.ranks import free_port, timing_trainer

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "default": {"vocab_size": 4096, "n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64, "batch": 4},
    "tiny": {"vocab_size": 256, "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 16, "batch": 2},
}
VARIANTS: dict[str, dict | str] = {
    "ddp": "ddp",
    "ddp_bf16_hook": "bf16_hook",
    "stage_2": {"stage": 2},
    "stage_2_bf16_reduce": {"stage": 2, "reduce_dtype": "bf16"},
    "stage_2_int8_reduce": {"stage": 2, "reduce_dtype": "int8"},
    "stage_3": {"stage": 3},
    "stage_3_bf16_reduce": {"stage": 3, "reduce_dtype": "bf16"},
    "stage_3_int8_gather": {"stage": 3, "gather_dtype": "int8"},
    "stage_3_int8_reduce": {"stage": 3, "reduce_dtype": "int8"},
    "stage_3_int8_both": {"stage": 3, "gather_dtype": "int8", "reduce_dtype": "int8"},
    "hybrid_per_node": {"stage": 3, "shard_group_size": "node"},
}
LINKS = ("loopback", "10gbit", "1gbit")


def _strategy(variant: str):  # noqa: ANN202
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_shardlab import ShardLabStrategy

    options = VARIANTS[variant]
    if options == "ddp":
        return DDPStrategy()
    if options == "bf16_hook":
        return DDPStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook)
    return ShardLabStrategy(**options)


def run_rank(variant: str, setting_name: str, warmup: int, steps: int, ranks_per_node: int) -> dict:
    """One rank of one variant: its timed steps, peak RSS and (shardlab) the ledger's bytes per step by dtype."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    setting, times, by_dtype = SETTINGS[setting_name], [], {}
    world = int(os.environ["WORLD_SIZE"])

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:  # noqa: ANN001
            if batch_idx == warmup and hasattr(trainer.strategy, "sharded"):
                trainer.strategy.sharded.comm.ledger.reset()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
            times.append(time.perf_counter() - self.t)
            if batch_idx == warmup + steps - 1 and hasattr(trainer.strategy, "sharded"):
                ledger = trainer.strategy.sharded.comm.ledger
                by_dtype.update({f"{k}:{d}": t.bytes / steps for (k, d), t in ledger.by_dtype.items()})

    tokens = _tokens(setting, warmup + steps, world)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    trainer = timing_trainer(
        accelerator="cpu",
        devices=ranks_per_node,
        num_nodes=world // ranks_per_node,
        strategy=_strategy(variant),
        max_steps=warmup + steps,
        callbacks=[Clock()],
    )
    model = _model(setting)
    trainer.fit(model, loader)
    return {
        "times": times[warmup:],
        "peak_rss": _peak_rss(),
        "params": sum(p.numel() for p in model.parameters()),
        "bytes_by_dtype": by_dtype,
    }


def _loopback_env(rank: int, world: int, ranks_per_node: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % ranks_per_node),
        "NODE_RANK": str(rank // ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
    }


def _spawned(rank: int, envs: list[dict], ports: list[int], plan: list[dict], out) -> None:  # noqa: ANN001
    """One rank for the whole invocation: every (repeat, variant) fit in turn, in this process (the fits reuse its
    the environment as it was and a port of its own, as the tests' kept worlds do), so a rank's start is paid once,
    not once per variant."""
    from benchmarks.slow_link import enter_from_env

    os.environ.update(envs[rank], OMP_NUM_THREADS="1")
    enter_from_env()
    import torch

    torch.set_num_threads(1)
    results, environ = [], dict(os.environ)
    for kwargs, port in zip(plan, ports):
        os.environ.clear()
        os.environ.update(environ, MASTER_PORT=str(port))
        results.append(run_rank(**kwargs))
        if rank == 0:
            print(kwargs["variant"], f"{statistics.median(results[-1]['times']):.4f} s/step", flush=True)
    out[rank] = results


def measure(args: argparse.Namespace) -> dict:
    """Every variant, ``repeats`` times interleaved, on the link ``args.link`` (made and removed here)."""
    from contextlib import nullcontext

    import torch.multiprocessing as mp

    from benchmarks.slow_link import EmulatedLink, probe_link, run_ranks

    world = args.nodes * args.ranks_per_node
    common = {"setting_name": args.setting, "warmup": args.warmup, "steps": args.steps}
    plan = [
        {"variant": v, "ranks_per_node": args.ranks_per_node, **common}
        for _ in range(args.repeats)
        for v in args.variants
    ]
    context = nullcontext(None) if args.link == "loopback" else EmulatedLink(args.nodes, args.link)
    samples: dict[str, list[dict]] = {v: [] for v in args.variants}
    with context as link:
        probed = run_ranks(link, probe_link, 1)[0] if link is not None else None
        envs = [
            _loopback_env(r, world, args.ranks_per_node)
            if link is None
            else {**link.rank_env(r, world, args.ranks_per_node), "LOCAL_WORLD_SIZE": str(args.ranks_per_node)}
            for r in range(world)
        ]
        with mp.Manager() as manager:
            out = manager.dict()
            ports = [free_port() for _ in plan]
            mp.spawn(_spawned, args=(envs, ports, plan, out), nprocs=world, join=True)
            ranks = [out[r] for r in range(world)]
    for i, kwargs in enumerate(plan):
        samples[kwargs["variant"]].append(
            {
                "seconds": statistics.median(ranks[0][i]["times"]),
                "peak_rss": max(r[i]["peak_rss"] for r in ranks),
                "params": ranks[0][i]["params"],
                "bytes_by_dtype": ranks[0][i]["bytes_by_dtype"],
            }
        )
    return {"link": args.link, "probed": probed, "args": vars(args), "machine": machine(), "samples": samples}


def _median(runs: list[dict]) -> float:
    return statistics.median(r["seconds"] for r in runs)


def table(results: dict[str, dict]) -> str:
    """The markdown: each variant's s/step on each link, against DDP, DDP's bf16 hook and stage 3 exact."""
    links = [link for link in LINKS if link in results]
    first = results[links[0]]
    a = first["args"]
    head = ["variant"] + [f"{link}: s/step (vs ddp, vs bf16 hook, vs stage 3)" for link in links] + ["bytes/step"]
    rows = []
    for variant in a["variants"]:
        cells = [variant]
        for link in links:
            runs = results[link]["samples"].get(variant)
            peers = {v: _median(r) for v, r in results[link]["samples"].items() if r}
            if not runs:
                cells.append("-")
                continue
            m = _median(runs)
            ratios = ", ".join(f"{m / peers[p]:.2f}" for p in ("ddp", "ddp_bf16_hook", "stage_3") if p in peers)
            cells.append(f"{m:.3f} ({ratios})")
        moved = results[links[0]]["samples"][variant][0]["bytes_by_dtype"]
        kinds = ("all_gather", "reduce_scatter", "all_reduce")
        cells.append(", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(moved.items()) if k.split(":")[0] in kinds))
        rows.append("| " + " | ".join(cells) + " |")
    probes = "; ".join(
        f"{link}: probe read {results[link]['probed']['bandwidth'] / 1e6:.0f} MB/s"
        for link in links
        if results[link]["probed"]
    )
    return "\n".join(
        [
            "# Slow links: fewer bytes against DDP",
            "",
            "Commands: "
            + ", ".join(f"`python -m benchmarks.fewer_bytes --link {link}`" for link in links)
            + ", then `python -m benchmarks.fewer_bytes --table`.",
            "",
            f"Machine: {first['machine']}. {a['nodes']} nodes x {a['ranks_per_node']} ranks, 1 thread each (gloo), "
            f"fp32 AdamW, GPT setting '{a['setting']}' ({first['samples']['ddp'][0]['params']:,} parameters); "
            f"{a['repeats']} interleaved repeats of {a['steps']} steps after {a['warmup']} warm-up. Links: {probes}.",
            "",
            "| " + " | ".join(head) + " |",
            "| " + " | ".join("---" for _ in head) + " |",
            *rows,
            "",
            "Bytes/step: the ledger's full-tensor bytes by kind and wire dtype (rank 0; shardlab variants only).",
        ]
    )


def picture(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [link for link in LINKS if link in results]
    variants = results[links[0]]["args"]["variants"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(links)
    for i, link in enumerate(links):
        ddp = _median(results[link]["samples"]["ddp"])
        values = [_median(results[link]["samples"][v]) / ddp for v in variants]
        ax.bar([j + i * width for j in range(len(variants))], values, width, label=link)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(links) - 1) / 2 for j in range(len(variants))], variants, rotation=35, ha="right")
    ax.set_ylabel("s/step / DDP's s/step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="1gbit", help="loopback, or a tc rate: 1gbit, 10gbit")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--setting", default="default", choices=sorted(SETTINGS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--table", action="store_true", help="combine the links' JSON files into the table")
    parser.add_argument("--dir", default=str(HERE))
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    if args.table:
        results = {
            link: json.loads((directory / f"SLOW_LINKS_{link}.json").read_text())
            for link in LINKS
            if (directory / f"SLOW_LINKS_{link}.json").exists()
        }
        text = table(results)
        (directory / "SLOW_LINKS.md").write_text(text + "\n")
        picture(results, directory / "SLOW_LINKS.png")
        print(text)
        return
    results = measure(args)
    (directory / f"SLOW_LINKS_{args.link}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
