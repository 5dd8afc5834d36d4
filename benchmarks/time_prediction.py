"""The time side of the budget, measured against predicted, on the example GPT at stages 1-3 and a 2x2 hybrid layout,
and a tiny 4-block stack whose step is mostly per-op and per-unit costs (benchmarks/time_prediction_zoo.py: more).

    python -m benchmarks.time_prediction                  # 3 repeats -> benchmarks/TIME_PREDICTION.md
    python -m benchmarks.time_prediction --quick          # 1 repeat, printed only
    python -m benchmarks.time_prediction --zoo --four --repeats 2   # six models instead: time_prediction_zoo.py

Each variant is a Lightning fit with ``ShardLabBudget`` of bench.py's default GPT (6 blocks, width 384, 128 tokens,
batch 8 per rank; fp32 AdamW), 2 CPU ranks with one thread each (gloo), or 4 ranks in 2 shard groups of 2
(``shard_group_size=2``). What each rank's report holds is compared: ``time_measured`` (the step clock,
budget/measured/step_time.py) against ``time_predicted`` (the step played on the engine's schedule from the first
batch's traced work and the run's own links, timed at the end of fit: budget/predicted/run_time.py), for the step,
its parts and each collective kind (on gloo's wire: from each launch to the end of its wait, predicted ``to_wait``;
and the part waited for, ``exposed``). Variants run in turn within each repeat; the ratios are medians over repeats
of rank 0's.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench import SETTINGS, _model, _tokens, machine
from benchmarks.ranks import run_ranks, timing_trainer

HERE = Path(__file__).resolve().parent
VARIANTS = {  # name -> (ranks, stage, shard group size, model)
    "stage 1": (2, 1, None, "gpt"),
    "stage 2": (2, 2, None, "gpt"),
    "stage 3": (2, 3, None, "gpt"),
    "stage 3, 2x2 hybrid": (4, 3, 2, "gpt"),
    "tiny stack, stage 3": (2, 3, None, "stack"),
}
STACK = {"vocab": 64, "width": 48, "blocks": 4, "seq": 32, "batch": 4}  # a step of about 20 ms: mostly per-op costs
READING = """Reading it. The step and its compute parts are priced from the first batch's traced work at rates measured
on this machine, and land near the measurement at stages 1-3 and on the 2x2 layout. The ranks of one machine take
turns to measure the compute rate (budget/callback.py), and each then gets its share of the cores
(``sharing_cores``): the 2x2 layout runs 4 ranks on 2 cores, half the rate each. (Until 2026-12-05 the four probes ran
at once, already sharing the cores, and the share was taken again: the 2x2 step was predicted at twice its time.)

The link is timed at the end of fit with batches of 4 all-gathers launched together at two sizes, its bandwidth the
slope between them and its latency what remains (budget/measured/local_link.py). (Until 2026-12-05 the latency was
a one-element call's time, which on this machine jumps between ~0.5 and ~4 ms from one run to the next while calls of
real size do not; subtracting it made the link read up to 9 times too fast or 2 times too slow, and the stage 1-2
refresh all-gathers came out at 0.54-0.67.)

A call's time in flight cannot be measured on gloo's wire: its point-to-point works have no future and report
completion only once waited for (tried: ``is_completed()`` stays False for a second on a 1000-element exchange that
takes microseconds, until ``wait()``). So the measured side counts each call from its launch to the end of its wait,
and the rows "launch to wait" hold it against the same span predicted (``to_wait``), not against the predicted time
in flight; ``comm_hidden`` (to the wait, or the end if seen sooner) is likewise an upper bound here.

Contention between compute and communication. On a 2-core machine gloo's threads that carry a collective share the
two cores with the two ranks computing, so a collective launched behind compute moves little until its rank waits.
The model gives each link a share of its speed while its rank computes (compute_rate.py's ``link_share``: what the
ranks' compute threads leave of the cores, one per rank: 0 here, 1 on a GPU or a CPU with cores to spare) and full
speed while compute waits. (Until 2026-12-05 it priced the link as it runs idle: stage 3's exposed all-gathers
measured 4.0x the prediction, its ``comm_hidden`` 17x. A share measured by a probe, an all-gather launched behind
matrix products, was tried before and left out: it read 0.01 to 0.71 from run to run.) The row ``blocked`` is
``comm_exposed`` + ``waiting_for_ranks``: the model takes the ranks as equal, so what it predicts exposed is all the
time compute is blocked, and the measured side splits that time by who was late. Where ``blocked`` reads above 1.33
the rest is ``waiting_for_ranks``, not communication: at stage 3 rank 0 waits 35-45 ms a step for rank 1 to arrive,
most of it at the reduce-scatters (the rows "exposed" by kind count only the part after the last rank arrived). The
links are timed once per run and read 0.9-1.2 GB/s from run to run here, which moves the rows of communication by
as much (stage 1's reduce-scatters, all launched at the end of backward: 1.14, 1.26 and 1.50 in three tables)."""
PARTS = ("step", "forward", "backward", "optimizer", "comm_exposed", "comm_hidden", "blocked")


def _seconds(times: dict, key: str) -> float:
    """A part of a step's time; ``blocked``: comm_exposed + waiting_for_ranks (the model takes the ranks as equal,
    so what it predicts exposed is all the time compute is blocked)."""
    return times["comm_exposed"] + times["waiting_for_ranks"] if key == "blocked" else times[key]


def tiny_stack() -> Any:
    """The issue's model nobody tuned for: an embedding 48 wide, four small blocks (each its own unit), a linear
    head, AdamW; ``STACK`` sizes."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm, self.up, self.down = (
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.Linear(4 * width, width),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(STACK["vocab"], STACK["width"])
            self.blocks = nn.ModuleList(Block(STACK["width"]) for _ in range(STACK["blocks"]))
            self.head = nn.Linear(STACK["width"], STACK["vocab"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            loss = F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Stack(), Block


def run_rank(stage: int, group: int | None, steps: int, out: str, model: str = "gpt") -> dict:
    import os

    import torch
    from rich.console import Console
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabBudget, ShardLabStrategy

    setting = SETTINGS["default"]
    world = int(os.environ["WORLD_SIZE"])
    if model == "stack":
        module, block = tiny_stack()
        n = STACK["batch"] * steps * world
        tokens = torch.randint(0, STACK["vocab"], (n, STACK["seq"] + 1), generator=torch.Generator().manual_seed(0))
        batch, units = STACK["batch"], {"unit_classes": [block]}
    else:
        module, tokens, batch, units = _model(setting), _tokens(setting, steps, world), setting["batch"], {}
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    budget = ShardLabBudget(Console(file=io.StringIO()))
    strategy = ShardLabStrategy(stage=stage, shard_group_size=group, **units)
    trainer = timing_trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, callbacks=[budget], default_root_dir=out
    )
    trainer.fit(module, loader)
    report = budget.reports[trainer.global_rank]
    return {k: report[k] for k in ("time_measured", "time_predicted", "time_by_collective")}


def ratios(report: dict) -> dict[str, float]:
    measured, predicted = report["time_measured"], report["time_predicted"]
    out = {k: _seconds(measured, k) / _seconds(predicted, k) for k in PARTS if _seconds(predicted, k)}
    for kind, times in report["time_by_collective"].items():
        kinds = predicted.get("by_collective", {}).get(kind, {})
        if kinds.get("to_wait"):  # gloo's wire: a call's completion is seen at its wait (measured/step_time.py)
            out[f"{kind} launch to wait"] = (times["comm_hidden"] + times["comm_exposed"]) / kinds["to_wait"]
        if kinds.get("exposed"):
            out[f"{kind} exposed"] = times["comm_exposed"] / kinds["exposed"]  # waiting for a later rank: not priced
    return out


def main(argv: list[str] | None = None) -> None:
    if "--zoo" in (argv := sys.argv[1:] if argv is None else argv):  # the zoo, its own options passed on
        from benchmarks import time_prediction_zoo

        return time_prediction_zoo.main([a for a in argv if a != "--zoo"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=list(VARIANTS), action="append", help="run this variant (repeatable); not saved")
    p.add_argument("--zoo", action="store_true", help="six models instead (time_prediction_zoo.py; its --help)")
    args = p.parse_args(argv)
    chosen = {name: VARIANTS[name] for name in args.only or VARIANTS}
    samples: dict[str, list[dict]] = {name: [] for name in chosen}
    for repeat in range(1 if args.quick else args.repeats):
        for name, (world, stage, group, model) in chosen.items():
            kwargs = {"stage": stage, "group": group, "steps": args.steps, "out": f"/tmp/time_prediction/{repeat}"}
            kwargs["model"] = model
            ranks = run_ranks(run_rank, world, kwargs)
            samples[name].append(ranks[0])
            print(name, {k: round(v, 3) for k, v in ratios(samples[name][-1]).items()}, flush=True)
            steps = [(r["time_measured"]["step"] * 1e3, r["time_predicted"]["step"] * 1e3) for r in ranks]
            print("  step ms by rank, measured / predicted:", ", ".join(f"{m:.1f} / {p:.1f}" for m, p in steps))
    text = report(samples, args)
    print(text)
    if not args.quick and not args.only:
        path = HERE / "TIME_PREDICTION.md"  # the zoo's section (time_prediction_zoo.py) is kept
        zoo = path.read_text().partition("\n## The zoo")[2] if path.exists() else ""
        path.write_text(text + (f"\n## The zoo{zoo}" if zoo else ""))


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}"


def report(samples: dict[str, list[dict]], args: argparse.Namespace) -> str:
    lines = [
        "# Time per step: measured against predicted",
        "",
        f"Command: `python -m benchmarks.time_prediction --repeats {args.repeats} --steps {args.steps}`"
        f" ({time.strftime('%Y-%m-%d')}). Machine: {machine()}.",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        "| variant | part | measured ms | predicted ms | measured / predicted |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, runs in samples.items():
        keys = sorted({k for r in runs for k in ratios(r)}, key=lambda k: (k not in PARTS, k))
        for key in keys:
            rs = [ratios(r)[key] for r in runs if key in ratios(r)]
            if key in PARTS:
                m = _ms([_seconds(r["time_measured"], key) for r in runs])
                pr = _ms([_seconds(r["time_predicted"], key) for r in runs])
            else:
                m = pr = "-"
            lines.append(f"| {name} | {key} | {m} | {pr} | {statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) |")
    return "\n".join([*lines, "", READING]) + "\n"


if __name__ == "__main__":
    main()
