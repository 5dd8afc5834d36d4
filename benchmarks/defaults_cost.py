"""What the correct defaults cost: each one against the same run without it, on the 14M GPT on 2 CPU ranks.

    python -m benchmarks.defaults_cost            # about 6 min on 2 idle cores; writes its section of RESULTS.md
    python -m benchmarks.defaults_cost --quick    # tiny GPT, seconds: checks that the script runs

The defaults, and what each is measured against (one variant switches one of them off):

    current weights     after an optimizer step the refresh all-gathers (stages 1-2) are waited for before
                        the step returns, so a callback reads updated weights; against: left in flight
                        until each unit's next forward (the earlier behaviour, stale between steps)
    exact unused        find_unused_parameters=True: one all-reduce per step of one int32 per parameter
                        tensor, so parameters no rank used keep a None gradient; against: False
    verified            verify_collectives=True: every collective's header exchanged first; against: off

Variants run interleaved (the order rotates every repeat) on one sharded model per stage, in a plain
training loop (forward, backward, AdamW step), each block of ``--steps`` steps starting after a barrier;
a block's time is the slowest rank's. Cost of a default = median over repeats of (defaults' step time /
the variant's without it, same repeat) - 1, with the min-max over repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.ranks import free_port
from benchmarks.sanity_overhead import join, spread
from benchmarks.sections import MARKERS, replace_section
from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer
from lightning_shardlab.comm import collectives
from lightning_shardlab.examples.gpt import GPT

VARIANTS = {  # name -> (wait for the refresh, find_unused_parameters, verify_collectives)
    "defaults": (True, True, True),
    "without current weights": (False, True, True),
    "without exact unused": (True, False, True),
    "without verified": (True, True, False),
}
COSTS = {
    "current weights": "without current weights",
    "exact unused": "without exact unused",
    "verified": "without verified",
}
BEGIN, END = MARKERS["defaults_cost"]


def block(model: GPT, sharded, optimizer, batches: list) -> list[float]:  # noqa: ANN001
    """This rank's seconds per step over ``batches``; of them, in the refresh after the optimizer step and
    blocked in the unused-parameter all-reduce (measured directly: other jobs barely move them); and the CPU
    seconds the process used per step (all threads, gloo's included)."""
    refresh, spent = sharded.refresh, [0.0]

    def timed_refresh(changed) -> None:  # noqa: ANN001
        started = time.perf_counter()
        refresh(changed)
        spent[0] += time.perf_counter() - started

    sharded.refresh = timed_refresh  # an instance attribute: after_optimizer_step looks it up on the instance
    before = sharded.comm.ledger.snapshot().get(("world", "all_reduce", "unused parameters"), (0, 0, 0.0))[2]
    collectives.barrier(sharded.comm, label="start of a timed block")
    start, cpu = time.perf_counter(), time.process_time()
    for x, y in batches:
        optimizer.zero_grad()
        with sharded.step(keep_root_gathered=True):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (b*t, vocab), (b*t,)
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
    sharded.wait_gathers()  # a refresh left in flight is paid for inside the block
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del sharded.refresh
    unused = sharded.comm.ledger.snapshot().get(("world", "all_reduce", "unused parameters"), (0, 0, 0.0))[2] - before
    return [seconds / len(batches), spent[0] / len(batches), unused / len(batches), cpu / len(batches)]


def models(stage: int, rank: int, world: int, sizes: dict) -> dict:
    """One sharded model per find_unused_parameters value, the same weights, verification switchable."""
    out = {}
    for unused in (True, False):
        comm = Comm(rank=rank, world_size=world, device=torch.device("cpu"))
        torch.manual_seed(0)
        model = GPT(**sizes)
        sharded = shard_model(model, ShardLabConfig(stage=stage, find_unused_parameters=unused), comm)
        sharded.verify_collectives()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        shard_optimizer(optimizer, sharded)
        out[unused] = (model, sharded, optimizer, sharded.comm.wire)
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    sizes, batches = join(rank, world, port, args)
    out = {}
    for stage in args.stages:
        runs = models(stage, rank, world, sizes)
        for model, sharded, optimizer, _ in runs.values():
            block(model, sharded, optimizer, batches[:2])  # warm-up
        names = list(VARIANTS)
        times: dict[str, list[list[float]]] = {n: [] for n in names}
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                wait, unused, verify = VARIANTS[name]
                model, sharded, optimizer, wire = runs[unused]
                sharded._overlap_refresh = not wait
                sharded.comm.wire = wire if verify else None  # unverified: the transport chosen at setup
                measured = torch.tensor(block(model, sharded, optimizer, batches), dtype=torch.float64)
                sharded.comm.wire = wire
                collectives.all_reduce(measured, sharded.comm, op="max", label="timings")  # the slowest rank's
                times[name].append(measured.tolist())
        out[stage] = times
    if rank == 0:
        results.update(out)
        results["params"] = sum(p.numel() for p in GPT(**sizes).parameters())
    dist.destroy_process_group()


def section(results: dict, args: argparse.Namespace, seconds: float) -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    lines = [
        BEGIN,
        "## What the correct defaults cost\n",
        f"Command: `{' '.join(['python -m benchmarks.defaults_cost', *sys.argv[1:]])}` ({seconds / 60:.1f} min)."
        f" Machine: {cpu}; {os.cpu_count()} cores; torch {torch.__version__}; 2 ranks (gloo), 1 thread each."
        f" Model: nanoGPT-shaped GPT, {results['params']:,} parameters, AdamW, {args.batch} sequences per rank and"
        f" step; {args.repeats} interleaved repeats of {args.steps} steps per variant.\n",
        "A/B: the defaults' step time over the same run without one of them, minus 1, per repeat (blocks run"
        " back to back): median (min to max), and best against best (the least disturbed block of each).",
        " Direct: what the defaults spend, measured inside the step (other jobs barely move it): the refresh"
        " after the optimizer step, and the time blocked in the unused-parameter all-reduce, per step and as a"
        " share of the fastest defaults step.\n",
        "| stage | step, defaults, ms | current weights: A/B, best | refresh, ms (share) | exact unused: A/B, best |"
        " its all-reduce, ms (share) | verified collectives: A/B, best | verified: CPU time A/B |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage in args.stages:
        steps = {n: [row[0] for row in rows] for n, rows in results[stage].items()}
        fastest = min(steps["defaults"])
        direct = {k: [row[i] for row in results[stage]["defaults"]] for k, i in (("refresh", 1), ("unused", 2))}
        cells = []
        for name, other in COSTS.items():
            ab = spread([d / w - 1 for d, w in zip(steps["defaults"], steps[other])], 100, "{:+.1f} %")
            cells.append(f"{ab}, {100 * (fastest / min(steps[other]) - 1):+.1f} %")
            key = {"current weights": "refresh", "exact unused": "unused"}.get(name)
            if key:
                cells.append(
                    f"{spread(direct[key], 1000, '{:.1f}')} ({100 * statistics.median(direct[key]) / fastest:.1f} %)"
                )
        cpu = {n: [row[3] for row in rows] for n, rows in results[stage].items()}
        cells.append(spread([d / w - 1 for d, w in zip(cpu["defaults"], cpu["without verified"])], 100, "{:+.1f} %"))
        lines.append(f"| {stage} | {spread(steps['defaults'], 1000, '{:.0f}')} | " + " | ".join(cells) + " |")
    raw = "; ".join(
        f"stage {s}: "
        + ", ".join(f"{n} {1000 * statistics.median(r[0] for r in rows):.0f} ms" for n, rows in results[s].items())
        for s in args.stages
    )
    lines += [
        "",
        f"Median step times: {raw}.",
        "",
        "At stage 3 the refresh re-gathers the root unit only when it is held"
        " (the other units are gathered in their next forward anyway), so there it is the compute-shard copy.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).with_name("RESULTS.md")))
    args = parser.parse_args()
    start = time.monotonic()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(2, free_port(), args, results), nprocs=2, join=True)
        results = dict(results)
    text = section(results, args, time.monotonic() - start)
    print(text)
    if not args.quick:
        replace_section(Path(args.out), "defaults_cost", text)


if __name__ == "__main__":
    main()
