"""Ways to price a collective's cost to a busy CPU rank, compared on the same fits: the zoo's models and variants
(time_prediction_zoo.py) are fitted once, and each fit's first batch, rate and link are priced again under each
way, so that what differs between the ways is the model alone, not the run-to-run noise of a shared machine.

    python -m benchmarks.time_prediction_variants            # 2 ranks -> a section of benchmarks/TIME_PREDICTION.md

The link probe splits what one small call costs a rank that computes around it into the compute it takes
(``Interconnect.launch``, charged where the engine launches a call) and the wait it blocks (a busy rank's latency,
``Interconnect.busy_latency``, where that is the longer: comm/link_probe.py); calls waited for back to back take the
latency timed in batches. The ways: as the budget prices it; a busy rank's latency on every call, back-to-back ones
too (as it was priced until the fourth session of 2026-12-06); the launch moved into the wait (latency + launch /
(N-1), no launch); no launch at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from typing import Any

from benchmarks.bench import machine
from benchmarks.ranks import run_ranks
from benchmarks.time_prediction_zoo import HERE, MODELS, fits
from benchmarks.time_prediction_zoo import SECTION as ZOO

SECTION = "## Ways to price a call, on the same fits"
READING = """Reading it. On a CPU whose cores all compute (``link_share`` 0) a call moves only while its rank waits, so
a second of its cost paid as compute or as waiting makes the same step: the launch paid as compute or in the wait differ
only in which part shows it. Without the per-call cost most steps come out short: the busy probe's cost is real; what it
cannot pin down from one fit to the next (comm/link_probe.py) is how it splits between compute and waiting. Since the
fourth session of 2026-12-06 a call's messages take a busy rank's latency only where compute runs while it is pending
(clocks.py), the latency timed in batches where it is waited for back to back (the refresh after the optimizer step, the
reductions at the end of backward): on the same fits the step's median |log| went from 0.14 to 0.10 (the first two rows
above; 21 of 24 steps within either way, the parts alike), and on a second set of fits from 0.18 to 0.17 (19 of 24
either way). The same benchmark's earlier runs, on other fits: 18 of 24 and then 16 of 24 steps within, as the budget
priced it then; which part shows a call's cost moved between those sets of fits, the step did not."""


PARTS = ("step", "forward", "backward", "optimizer", "comm_exposed")


def _ways(link: Any, world: int) -> dict[str, Any]:
    return {
        "as the budget prices it": link,
        "a busy rank's latency on every call": dataclasses.replace(
            link, latency=max(link.latency, link.busy_latency), busy_latency=0.0
        ),
        "launch moved into the wait": dataclasses.replace(
            link, latency=link.latency + link.launch / max(world - 1, 1), launch=0.0
        ),
        "no launch": dataclasses.replace(link, launch=0.0),
    }


def run_rank(models: list[str], steps: int, out: str) -> list[dict]:
    """On every rank: each model at each variant fitted once, then its step priced each way (rank 0's rows)."""
    from lightning_shardlab.budget.predicted.compute_rate import ComputeRate, EngineCost
    from lightning_shardlab.budget.predicted.run_time import time_predicted_for_run
    from lightning_shardlab.budget.predicted.zero_table import Interconnect

    world, rows = int(os.environ["WORLD_SIZE"]), []
    for name, stage, micro, trainer, strategy, budget, report in fits(models, steps, out, world):
        measured, basis = report["time_measured"], report["time_predicted"].get("basis")
        if basis is None:
            continue
        rate = ComputeRate(
            basis["rate"], basis["flops_per_second"], basis["bytes_per_second"], basis["seconds_per_op"], "cpu",
            engine=EngineCost(**basis["engine_seconds"]), seconds_per_bare_op=basis["seconds_per_bare_op"],
        )  # fmt: skip
        priced = {}
        for way, link in _ways(Interconnect(**basis["link_figures"]), world).items():
            out_ = time_predicted_for_run(
                strategy.sharded, budget.predicted_work, micro, "32-true", link=link, rate=rate,
                optimizers=trainer.optimizers, link_share=basis["link_share"], data_seconds=measured["data"],
            )  # fmt: skip
            priced[way] = {k: out_[k] for k in PARTS}
        rows.append({"model": name, "stage": stage, "micro": micro, "measured": measured, "priced": priced})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """A line per way: the steps within 0.75-1.33, and the median |log(measured / predicted)| of the step and of
    each part above 10 % of the measured step."""
    lines = ["| way | steps within 0.75-1.33 | step | forward | backward | optimizer | comm_exposed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for way in rows[0]["priced"]:
        cells = []
        for part in PARTS:
            logs = [
                abs(math.log(r["measured"][part] / r["priced"][way][part]))
                for r in rows
                if r["priced"][way][part] > 0 and r["measured"][part] > 0.1 * r["measured"]["step"]
            ]
            cells.append(f"{statistics.median(logs):.2f} ({len(logs)})" if logs else "-")
        ratios = [r["measured"]["step"] / r["priced"][way]["step"] for r in rows]
        within = sum(1 for x in ratios if 0.75 <= x <= 1.33)
        lines.append(f"| {way} | {within} of {len(rows)} | {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    began, rows = time.perf_counter(), []
    for model in MODELS:  # fresh ranks for each model, as in the zoo
        rows += run_ranks(run_rank, args.ranks, {"models": [model], "steps": args.steps, "out": "/tmp/variants"})[0]
    text = "\n".join([
        SECTION, "",
        f"Command: `python -m benchmarks.time_prediction_variants --ranks {args.ranks}` ({time.strftime('%Y-%m-%d')},"
        f" {time.perf_counter() - began:.0f} s). Machine: {machine()}.", "",
        __doc__.split("\n\n", 2)[2].strip(), "",
        "A cell: the median |log(measured / predicted)| of rank 0's rows, and how many rows it is over (the parts"
        " above 10 % of the measured step).", "",
        *summary(rows), "", READING,
    ])  # fmt: skip
    print(text)
    write_section(text)


def write_section(text: str) -> None:
    """This section of TIME_PREDICTION.md in place of the one before, else before the zoo's (which ends the file)."""
    path = HERE / "TIME_PREDICTION.md"
    old = path.read_text()
    if SECTION in old:
        head, _, rest = old.partition(SECTION)
        tail = rest[rest.index("\n## ") + 1 :] if "\n## " in rest else ""
    else:
        head, _, tail = old.partition(ZOO)
        tail = ZOO + tail if tail else ""
    path.write_text(head.rstrip("\n") + "\n\n" + text + "\n\n" + tail)


if __name__ == "__main__":
    main()
