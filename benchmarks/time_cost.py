"""What measuring time costs: the 14M GPT's step on 2 ranks with the time side of the budget on and off.

    python -m benchmarks.time_cost              # 5 repeats, the section goes into benchmarks/RESULTS.md
    python -m benchmarks.time_cost --quick      # 1 repeat, printed, RESULTS.md untouched

The time side is ``TimeMeter`` (lightning_shardlab/budget/measured/step_time.py): a step clock on the run's Comm
(one ``perf_counter`` and a few list operations at every engine event: each unit's forward and backward begins and
ends, each collective is reached, launched, waited for; the collectives in flight polled for completion), and
every 5 steps one ``all_gather_object`` of what each rank lived. This runs bench.py's default GPT (6 blocks, width
384, 128 tokens, batch 8 per rank) on 2 CPU ranks (gloo, one thread each), stage 3, fp32 AdamW, in a plain loop of
forward, backward and step: in each repeat both variants, in turn first, in the same processes. Reported: the
median step of each, on / off per repeat, and directly the seconds per step spent inside the clock and the
exchange (timers around them) as a share of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench import SETTINGS, _model, _tokens
from benchmarks.ranks import run_ranks, timed
from benchmarks.sections import MARKERS, replace_section

HERE = Path(__file__).resolve().parent
CLOCK_METHODS = ("phase", "end_step", "enter", "leave", "arrive", "launched", "block", "unblock")


def _timed_meter(comm):  # noqa: ANN001, ANN202
    """A TimeMeter whose clock methods and exchanges add the seconds spent inside them to ``meter.inside``."""
    from lightning_shardlab.budget.measured.step_time import TimeMeter

    meter = TimeMeter(comm)
    meter.inside = 0.0

    def add(seconds: float) -> None:
        meter.inside += seconds

    for name in CLOCK_METHODS:
        setattr(meter.clock, name, timed(getattr(meter.clock, name), add))
    meter.exchange = timed(meter.exchange, add)
    return meter


def _loop(model, optimizer, tokens, batch: int, meter, warmup: int, steps: int) -> tuple[float, float]:  # noqa: ANN001
    times, inside = [], 0.0
    for i in range(warmup + steps):
        chunk = tokens[i * batch : (i + 1) * batch]
        started = time.perf_counter()
        before = meter.inside if meter else 0.0
        logits = model(chunk[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if meter:
            meter.end_step()
        if i >= warmup:
            times.append(time.perf_counter() - started)
            inside += (meter.inside - before) if meter else 0.0
    return statistics.median(times), inside / steps


def run_rank(repeats: int, warmup: int, steps: int) -> list[dict]:
    import torch.distributed as dist

    from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer

    setting = SETTINGS["default"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    comm = Comm(rank=rank, world_size=world, device=torch.device("cpu"))
    model = _model(setting)
    sharded = shard_model(model, ShardLabConfig(stage=3), comm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard_optimizer(optimizer, sharded)
    tokens = _tokens(setting, warmup + steps, world)[rank::world]
    rows = []
    for repeat in range(repeats):
        got = {}
        for on in (False, True) if repeat % 2 == 0 else (True, False):
            meter = _timed_meter(sharded.comm) if on else None
            got[on] = _loop(model, optimizer, tokens, setting["batch"], meter, warmup, steps)
            if meter:
                meter.report()  # the last exchange, as at the end of a run
                meter.stop()
        rows.append({"off": got[False][0], "on": got[True][0], "inside": got[True][1]})
    dist.destroy_process_group()
    return rows


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def section(rows: list[dict], args: argparse.Namespace) -> str:
    begin, end = MARKERS["time_cost"]
    ratios = [r["on"] / r["off"] for r in rows]
    shares = [r["inside"] / r["on"] for r in rows]
    return "\n".join(
        [
            begin,
            "## What measuring time costs",
            "",
            f"Command: `python -m benchmarks.time_cost --repeats {args.repeats} --warmup {args.warmup}"
            f" --steps {args.steps}` ({time.strftime('%Y-%m-%d')}; `nproc` {os.cpu_count()}, torch"
            f" {torch.__version__}). bench.py's default GPT on 2 CPU ranks (gloo, one thread each), stage 3, fp32"
            " AdamW, a plain loop; rank 0's figures. Both variants in the same processes, in turn first.",
            "",
            "| time side | s/step, median (min-max) | on / off per repeat | inside the clock and its exchanges,"
            " share of the step |",
            "| --- | --- | --- | --- |",
            f"| off | {_spread([r['off'] for r in rows], '.4f')} | 1 | - |",
            f"| on | {_spread([r['on'] for r in rows], '.4f')} | {_spread(ratios, '.3f')} | {_spread(shares, '.3%')} |",
            end,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1 repeat, printed; RESULTS.md untouched")
    args = p.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    rows = run_ranks(run_rank, 2, {"repeats": repeats, "warmup": args.warmup, "steps": args.steps})[0]
    for i, r in enumerate(rows):
        print(f"repeat {i}: off {r['off']:.4f} s, on {r['on']:.4f} s, inside {r['inside'] * 1e3:.3f} ms")
    text = section(rows, args)
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "time_cost", text)


if __name__ == "__main__":
    main()
