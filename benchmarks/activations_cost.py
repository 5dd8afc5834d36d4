"""What measuring activations costs: the 14M GPT's training step with the activation meter on and off.

    python -m benchmarks.activations_cost              # 7 repeats, the section goes into benchmarks/RESULTS.md
    python -m benchmarks.activations_cost --quick      # 1 repeat, printed, RESULTS.md untouched

``ShardLabBudget`` counts, around every training step, what autograd saves for backward, by unit
(lightning_shardlab/budget/activations.py: a ``saved_tensors_hooks`` pack hook and forward hooks on the units'
modules). The meter's work is the same at any world size (it counts this rank's saved tensors), so this runs
one process with one thread: bench.py's default GPT (6 blocks, width 384, 128 tokens, batch 8), sharded at
world size 1, stage 3, fp32 AdamW, a plain loop of forward, backward and step. Each repeat times both variants,
in turn first, in the same process; a sample is the median of the timed steps after warm-up. Reported: the
median step of each and on / off per repeat (median, min-max), and directly the seconds per step spent inside
the meter's hooks (timers around them) as a share of the step.
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
from benchmarks.sections import MARKERS, replace_section
from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer
from lightning_shardlab.budget.measured.activations import ActivationMeter

HERE = Path(__file__).resolve().parent


class TimedMeter(ActivationMeter):
    """The meter, with the seconds spent inside its pack hook and its unit hooks added up."""

    def __init__(self, sharded) -> None:  # noqa: ANN001
        super().__init__(sharded)
        self.inside = 0.0
        for handle in self.stack.handles:  # the unit hooks, timed too
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                hooks[handle.id] = self._timed(hooks[handle.id])

    def _timed(self, fn):  # noqa: ANN001, ANN202
        def timed(*args):  # noqa: ANN002, ANN202
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.inside += time.perf_counter() - started

        return timed

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return super()._pack(tensor)
        finally:
            self.inside += time.perf_counter() - started


def build():  # noqa: ANN201
    setting = SETTINGS["default"]
    model = _model(setting)
    sharded = shard_model(model, ShardLabConfig(stage=3), Comm.single())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard_optimizer(optimizer, sharded)
    return model, sharded, optimizer, _tokens(setting, 1, 1)


def step(model, optimizer, tokens: torch.Tensor) -> None:  # noqa: ANN001
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def sample(parts, meter: TimedMeter | None, warmup: int, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """Median seconds per step, and seconds per step inside the meter."""
    model, _, optimizer, tokens = parts
    times = []
    inside_before = meter.inside if meter else 0.0
    for i in range(warmup + steps):
        started = time.perf_counter()
        if meter:
            meter.start()
        step(model, optimizer, tokens)
        if meter:
            meter.stop()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    inside = (meter.inside - inside_before) / (warmup + steps) if meter else 0.0
    return statistics.median(times), inside


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1 repeat, printed; RESULTS.md untouched")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    parts = build()
    meter = TimedMeter(parts[1])
    rows = []
    for repeat in range(1 if args.quick else args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        got = {on: sample(parts, meter if on else None, args.warmup, args.steps) for on in order}
        rows.append({"off": got[False][0], "on": got[True][0], "inside": got[True][1]})
        print(f"repeat {repeat}: off {got[False][0]:.4f} s, on {got[True][0]:.4f} s, inside {got[True][1]:.5f} s")
    text = section(rows, args, meter.report())
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "activations_cost", text)


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def section(rows: list[dict], args: argparse.Namespace, report: dict) -> str:
    begin, end = MARKERS["activations_cost"]
    ratios = [r["on"] / r["off"] for r in rows]
    shares = [r["inside"] / r["on"] for r in rows]
    return "\n".join(
        [
            begin,
            "## What measuring activations costs",
            "",
            f"Command: `python -m benchmarks.activations_cost --repeats {args.repeats} --warmup {args.warmup}"
            f" --steps {args.steps}` ({time.strftime('%Y-%m-%d')}; `nproc` {os.cpu_count()}, torch"
            f" {torch.__version__}). bench.py's default GPT at world size 1, stage 3, fp32 AdamW, one thread; the"
            f" meter counted {report['total'] / 2**20:.1f} MiB saved for backward per step over"
            f" {len(report['by_unit'])} units.",
            "",
            "| meter | s/step, median (min-max) | on / off per repeat | inside the meter's hooks, share of the step |",
            "| --- | --- | --- | --- |",
            f"| off | {_spread([r['off'] for r in rows], '.4f')} | 1 | - |",
            f"| on | {_spread([r['on'] for r in rows], '.4f')} | {_spread(ratios, '.3f')} | {_spread(shares, '.2%')} |",
            end,
        ]
    )


if __name__ == "__main__":
    main()
