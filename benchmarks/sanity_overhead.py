"""What the sanity checks cost, as a share of step time, on a GPT of 14.3M parameters on 2 CPU ranks.

    python -m benchmarks.sanity_overhead                 # 5 min on 2 idle cores; writes benchmarks/SANITY.md
    python -m benchmarks.sanity_overhead --quick         # tiny GPT, seconds: checks that the script runs

Variants, run interleaved in one invocation (the order rotates every repeat), each for ``--steps`` steps
per repeat, on the same sharded model (a plain training loop: forward, backward, AdamW step):

    none          no checks
    fingerprints  the cheap collective check: every collective's fingerprint recorded, one 16-byte
                  all-gather every K steps
    verified      every collective's header exchanged before it moves data (comm/verify.py), nothing else
    cheap (all)   every check at its default: verified collectives, fingerprints, replicated-state
                  digests and the data check every K steps, the watchdog thread (1 s heartbeats through
                  the store) and the SIGTERM agreement (one store read per step)
    strict        debug mode: the above plus a store exchange before every collective

K = ``--every`` (default 10, the default of ``every_n_steps``).
A step's time is the slowest rank's (each block of steps starts after a barrier); the overhead of a
variant is the median over repeats of (its median step time / the baseline's in the same repeat) - 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.ranks import free_port
from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.call import CollectiveObserver
from lightning_shardlab.examples.gpt import GPT
from lightning_shardlab.guard.sanity_guard import SanityConfig, SanityGuard

FULL = dict(vocab_size=256, block_size=128, n_layer=8, n_head=6, n_embd=384)  # nanoGPT's shape: 14.3M parameters
QUICK = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
VARIANTS = ("none", "fingerprints", "verified", "cheap (all)", "strict")


def config(variant: str, every: int) -> SanityConfig | None:
    if variant == "none":
        return None
    if variant in ("fingerprints", "verified"):
        return SanityConfig(
            every_n_steps=every if variant == "fingerprints" else 0,
            check_replicated=False,
            check_data=False,
            collective_timeout_s=None,
            handle_sigterm=False,
            verify_collectives=variant == "verified",
        )
    return SanityConfig(every_n_steps=every, strict_collectives=variant == "strict")


class Account:
    """Direct accounting of the checks' own time, immune to other processes' noise: wall time the main
    thread spends in them (observers, before_step, stop_after) plus the watchdog thread's CPU time."""

    def __init__(self) -> None:
        self.main = 0.0  # main thread inside the checks
        self.thread = 0.0  # the watchdog thread's CPU

    def timed(self, fn, clock=time.perf_counter, field: str = "main"):  # noqa: ANN001, ANN201
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + clock() - start)

        return run


class TimedObserver(CollectiveObserver):
    def __init__(self, inner: CollectiveObserver, account: Account) -> None:
        self.started, self.finished = account.timed(inner.started), account.timed(inner.finished)


def train_block(model: GPT, sharded, optimizer, batches: list, guard: SanityGuard | None) -> tuple[float, float, float]:  # noqa: ANN001
    """(seconds per step, seconds of the checks per step, CPU seconds of the process per step), this rank."""
    account, observers, wire = Account(), list(sharded.comm.observers), sharded.comm.wire
    if guard is not None:
        sharded.comm.observers[:] = [TimedObserver(o, account) for o in observers]
        if guard.watchdog is not None:  # the thread looks the method up on every poll
            guard.watchdog._check = account.timed(guard.watchdog._check, time.thread_time, "thread")
        if wire is not None and guard.config.verify_collectives:
            wire.headers.check = account.timed(wire.headers.check)  # an instance attribute: the class's stays
    if guard is None or not guard.config.verify_collectives:
        sharded.comm.wire = None  # verified collectives are on for the variants that ask for them only
    collectives.barrier(sharded.comm, label="start of a timed block")
    start, cpu = time.perf_counter(), time.process_time()
    for step, (x, y) in enumerate(batches):
        if guard is not None:
            account.timed(guard.before_step)(step, (x, y))
        optimizer.zero_grad()
        with sharded.step(keep_root_gathered=True):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (b*t, vocab), (b*t,)
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
        if guard is not None:
            account.timed(guard.stop_after)(step)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    sharded.comm.observers[:] = observers
    if wire is not None:
        wire.headers.__dict__.pop("check", None)
        sharded.comm.wire = wire
    n = len(batches)
    return seconds / n, (account.main + account.thread) / n, cpu / n


def join(
    rank: int, world: int, port: int, args: argparse.Namespace
) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One rank of a benchmark: join the gloo group; the GPT's sizes and this rank's random token batches."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sizes = QUICK if args.quick else FULL
    g = torch.Generator().manual_seed(rank)
    shape = (args.batch, sizes["block_size"])
    batches = [
        (
            torch.randint(0, sizes["vocab_size"], shape, generator=g),
            torch.randint(0, sizes["vocab_size"], shape, generator=g),
        )
        for _ in range(args.steps)
    ]
    return sizes, batches


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results: dict) -> None:
    sizes, batches = join(rank, world, port, args)
    out = {}
    for stage in args.stages:
        comm = Comm(rank=rank, world_size=world, device=torch.device("cpu"))
        torch.manual_seed(0)
        model = GPT(**sizes)
        sharded = shard_model(model, ShardLabConfig(stage=stage), comm)
        sharded.verify_collectives()  # the verified wire exists; each variant switches it on or off
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        shard_optimizer(optimizer, sharded)
        train_block(model, sharded, optimizer, batches[:2], None)  # warm-up
        variants = tuple(args.variants)
        times: dict[str, list[float]] = {v: [] for v in variants}
        checks: dict[str, list[float]] = {v: [] for v in variants}
        cpus: dict[str, list[float]] = {v: [] for v in variants}
        for repeat in range(args.repeats):
            for variant in variants[repeat % len(variants) :] + variants[: repeat % len(variants)]:
                guard = (
                    None
                    if config(variant, args.every) is None
                    else SanityGuard(sharded, [optimizer], config(variant, args.every))
                )
                with guard if guard is not None else nullcontext():
                    measured = torch.tensor(train_block(model, sharded, optimizer, batches, guard))
                collectives.all_reduce(
                    measured, sharded.comm, op="max", label="timings"
                )  # the slowest rank sets the pace
                times[variant].append(float(measured[0]))
                checks[variant].append(float(measured[1]))
                cpus[variant].append(float(measured[2]))
        out[stage] = {
            "params": sum(p.numel() for p in GPT(**sizes).parameters()),
            "times": times,
            "checks": checks,
            "cpu": cpus,
        }
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def spread(values: list[float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """median (min to max)"""
    return (
        fmt.format(scale * statistics.median(values))
        + " ("
        + fmt.format(scale * min(values))
        + " to "
        + fmt.format(scale * max(values))
        + ")"
    )


def table(stage: int, entry: dict) -> str:
    base = entry["times"]["none"] if "none" in entry["times"] else None
    lines = [
        f"### stage {stage}\n",
        "| variant | step time, ms | checks' own time per step, ms | checks' time / baseline step |"
        " A/B: step time / baseline - 1 | A/B: CPU time / baseline - 1 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cpu_base = entry["cpu"]["none"] if "none" in entry["cpu"] else None
    for variant, times in entry["times"].items():
        own, cpu = entry["checks"][variant], entry["cpu"][variant]
        first = base is None or variant == "none"
        share = "—" if first else spread([c / min(base) for c in own], 100, "{:.2f} %")
        ab = "—" if first else spread([t / b - 1 for t, b in zip(times, base)], 100, "{:+.1f} %")
        cab = "—" if first else spread([t / b - 1 for t, b in zip(cpu, cpu_base)], 100, "{:+.1f} %")
        lines.append(f"| {variant} | {spread(times, 1000)} | {spread(own, 1000, '{:.2f}')} | {share} | {ab} | {cab} |")
    raw = "; ".join(f"{v}: " + ", ".join(f"{1000 * t:.0f}" for t in ts) for v, ts in entry["times"].items())
    return "\n".join(lines) + f"\n\nEach repeat's step time (ms), in order: {raw}.\n"


def report(results: dict, args: argparse.Namespace, seconds: float, load: tuple[float, float]) -> str:
    params = next(iter(results.values()))["params"]
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return "\n".join(
        [
            "# Sanity checks: cost per step\n",
            f"Command: `{' '.join(['python -m benchmarks.sanity_overhead', *sys.argv[1:]])}`"
            f" ({seconds / 60:.1f} min).  ",
            f"Machine: {cpu}; {os.cpu_count()} cores; torch {torch.__version__}; 2 ranks (gloo), 1 thread each;"
            f" load average (other jobs included) {load[0]:.1f} before, {load[1]:.1f} after.  ",
            f"Model: nanoGPT-shaped GPT, {params:,} parameters"
            f" ({'the --quick tiny GPT' if args.quick else '8 layers, width 384, context 128, vocabulary 256'}),"
            f" AdamW, {args.batch} sequences per rank and step.  ",
            f"{args.repeats} interleaved repeats of {args.steps} steps per variant;"
            f" checks every K = {args.every} steps.\n",
            "All figures: median (min to max) over repeats; per step, the slowest rank's. Two measures of the cost:\n",
            "- *checks' own time*, accounted directly (other processes' load barely moves it): the wall time the main"
            " thread spends inside the checks (collective observers, `before_step`, `stop_after`) plus the CPU time of"
            " the watchdog thread, per step, and as a share of the fastest baseline step (the one least slowed by other"
            " jobs). A check's all-gather (and a verified collective's header) also absorbs the wait for the slower"
            " rank, which the next collective would otherwise absorb, so this errs high.",
            "- *A/B*: each variant's step time against the no-check baseline of the same repeat: end to end, but on"
            " this shared 2-core machine other jobs move single blocks by tens of percent; the raw times are below. The"
            " same for the CPU time the process used (all its threads, gloo's included: what verified collectives'"
            " extra messages cost in work), which other jobs move less.\n",
            *(table(stage, entry) for stage, entry in results.items()),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).with_name("SANITY.md")))
    args = parser.parse_args()
    start, load_before = time.monotonic(), os.getloadavg()[0]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(2, free_port(), args, results), nprocs=2, join=True)
        results = dict(results)
    text = report(results, args, time.monotonic() - start, (load_before, os.getloadavg()[0]))
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
