"""What a hook's read of sharded gradients and weights costs against a training step (sharding/shard_reads.py).

    python -m benchmarks.hook_reads                 # tiny GPT, 9 interleaved rounds, section in RESULTS.md
    python -m benchmarks.hook_reads --quick         # 3 rounds, printed, RESULTS.md untouched

One fit per strategy (``ddp``, shardlab stage 1, stage 3) on 2 CPU ranks (1 thread each, gloo, fp32 AdamW), each step
timed from the first ``on_train_batch_start`` to the last ``on_train_batch_end`` callback, with what a hook reads:

    none         nothing
    grad_norm    ``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step``: every parameter's
                 gradient norm (under shardlab: one all-reduce of one number per parameter)
    weight_clone ``p.clone()`` of every weight in ``on_train_batch_end`` (under shardlab stage 3: one all-gather of
                 each parameter's pieces; stages 1-2 hold the weights, so no collective)

Repeats are interleaved at the step: after warm-up, each round runs one step of every variant in turn (none,
grad_norm, weight_clone), in one fit per strategy, so that drift and the other processes on the machine hit all alike.
Reported: each variant's median step, and the ratio of its step to the same round's step without reads (median,
min-max over the rounds), and the bytes its reads moved per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks.bench import SETTINGS, _model, _tokens
from benchmarks.ranks import run_ranks, timing_trainer
from benchmarks.sections import MARKERS, replace_section

HERE = Path(__file__).resolve().parent
STRATEGIES = ("ddp", "shardlab_stage_1", "shardlab_stage_3")
READS = ("none", "grad_norm", "weight_clone")


def run_reads(strategy: str, setting_name: str, warmup: int, rounds: int) -> dict:
    """One rank of one fit: after ``warmup`` steps, ``rounds`` rounds of one step per variant of ``READS``; each
    step's seconds and the bytes its reads moved (shardlab's ledger: the calls labelled ``read ...``)."""
    import lightning as L
    from lightning.pytorch.utilities import grad_norm
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabStrategy

    setting = SETTINGS[setting_name]
    world = int(os.environ["WORLD_SIZE"])
    seconds: dict[str, list[float]] = {r: [] for r in READS}
    moved: dict[str, list[int]] = {r: [] for r in READS}

    def read_bytes(trainer: L.Trainer) -> int:
        if not strategy.startswith("shardlab"):
            return 0
        ledger = trainer.strategy.sharded.comm.ledger
        return sum(t.bytes for (_, label), t in ledger.by_label.items() if label.startswith("read "))

    class Reader(L.Callback):
        def reads(self, trainer: L.Trainer) -> str:
            step = trainer.global_step - warmup
            return READS[step % len(READS)] if step >= 0 else "none"

        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            self.now, self.bytes = self.reads(trainer), read_bytes(trainer)
            self.t = time.perf_counter()

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:  # noqa: ANN001
            if self.now == "grad_norm":
                module.log_dict(grad_norm(module, norm_type=2))

        def on_train_batch_end(self, trainer, module, *args) -> None:  # noqa: ANN001, ANN002
            if self.now == "weight_clone":
                self.kept = [p.clone() for p in module.parameters()]
            if trainer.global_step > warmup:  # global_step counts this step already
                seconds[self.now].append(time.perf_counter() - self.t)
                moved[self.now].append(read_bytes(trainer) - self.bytes)

    tokens = _tokens(setting, warmup + rounds * len(READS), world)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    chosen = ShardLabStrategy(stage=int(strategy[-1])) if strategy.startswith("shardlab") else strategy
    trainer = timing_trainer(accelerator="cpu", devices=world, strategy=chosen, max_steps=warmup + rounds * len(READS))
    trainer.callbacks.insert(0, Reader())
    trainer.fit(_model(setting), loader)
    return {"seconds": seconds, "bytes": moved}


def sample(strategy: str, setting: str, warmup: int, rounds: int) -> dict:
    """Rank 0's steps by variant (the ranks step together)."""
    return run_ranks(run_reads, 2, {"strategy": strategy, "setting_name": setting, "warmup": warmup, "rounds": rounds})[
        0
    ]


def report(samples: dict[str, dict], setting: str, rounds: int, command: str) -> str:
    begin, end = MARKERS["hook_reads"]
    lines = [
        begin,
        "## What a hook's read of sharded gradients and weights costs",
        "",
        f"`{command}`: GPT `{setting}` ({SETTINGS[setting]}), 2 CPU ranks (1 thread each, gloo, fp32 AdamW), {rounds}"
        " rounds of one step per variant, interleaved in one fit per strategy. A read is a collective"
        " (sharding/shard_reads.py): Lightning's `grad_norm` all-reduces one number per parameter; a weight's"
        " `clone()` at stage 3 all-gathers its pieces (stages 1-2 hold the weights). Ratio: the step with the read"
        " over the same round's step without.",
        "",
        "| strategy | hook reads every step | s/step median | vs no reads: median (min-max) | read bytes/step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for strategy in STRATEGIES:
        seconds, moved = samples[strategy]["seconds"], samples[strategy]["bytes"]
        for reads in READS:
            ratios = [s / b for s, b in zip(seconds[reads], seconds["none"])]
            lines.append(
                f"| {strategy} | {reads} | {statistics.median(seconds[reads]):.4f} | {statistics.median(ratios):.3f}"
                f" ({min(ratios):.3f}-{max(ratios):.3f}) | {statistics.median(moved[reads]):,.0f} |"
            )
    lines.append(end)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 rounds, printed, RESULTS.md untouched")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    samples = {s: sample(s, args.setting, args.warmup, rounds) for s in STRATEGIES}
    command = "python -m benchmarks.hook_reads" + (" --quick" if args.quick else "")
    text = report(samples, args.setting, rounds, command)
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "hook_reads", text)


if __name__ == "__main__":
    main()
