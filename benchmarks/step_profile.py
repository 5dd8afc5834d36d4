"""Where a step's main-thread time goes, under Python's profiler: DDP against shardlab stages 2 and 3.

    python -m benchmarks.step_profile               # 3 repeats, the section goes into benchmarks/RESULTS.md
    python -m benchmarks.step_profile --quick       # 1 repeat, printed, RESULTS.md untouched

bench.py's default GPT (14M) on 2 CPU ranks (gloo, one thread each), fp32 AdamW, each variant in fresh processes, in
turn. ``cProfile`` runs on every rank over the steps after the warm-up; rank 0's own time (``tottime``) per step is
summed by where it was spent: this package's Python (the engine's hooks, state changes and checks; the example
GPT's own forward code is counted apart), Lightning's Python, the optimizer's update, blocked in a collective's
``wait``, posting sends and receives (gloo writes what the socket takes at once on the posting thread), and the
model's kernels (forward, and backward, which includes what DDP waits for inside it); the optimizer's update is the
cumulative time of torch's update function (``_single_tensor_adamw`` and its kind: its kernels are built-ins it
calls; the step around it also runs the closure, forward and backward). Profiled steps run slower than
plain ones (the profiler's own cost is spread over every Python call); the split is the point, the step times are
reported beside it for scale.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import platform
import pstats
import statistics
import time
from pathlib import Path

import torch

from benchmarks.ranks import run_ranks, timing_trainer
from benchmarks.sections import replace_section

HERE = Path(__file__).resolve().parent
UPDATES = ("_single_tensor_", "_multi_tensor_", "_fused_")  # torch's update functions, below the step's closure
VARIANTS = ("ddp", "shardlab_stage_2", "shardlab_stage_3")
PARTS = (
    "shardlab engine",
    "example GPT (Python)",
    "Lightning",
    "optimizer update",
    "blocked in wait",
    "posting sends/receives",
    "forward kernels",
    "backward (autograd engine)",
)


def _part(path: str, func: str) -> str | None:
    """The part a profiled function's own time belongs to (None: the rest)."""
    if "lightning_shardlab/examples" in path:
        return "example GPT (Python)"
    if "lightning_shardlab" in path:
        return "shardlab engine"
    if "/lightning/" in path:
        return "Lightning"
    if "_distributed_c10d" in func:
        return "blocked in wait" if "wait" in func else "posting sends/receives"
    if "run_backward" in func:
        return "backward (autograd engine)"
    if func.startswith("<built-in method torch._C._nn") or "scaled_dot_product" in func or "layer_norm" in func:
        return "forward kernels"
    return None


def profiled_rank(variant: str, warmup: int, steps: int) -> dict:
    """One rank's fit; per part, seconds per profiled step, and the plain step times before profiling."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.bench import SETTINGS, _model, _tokens
    from lightning_shardlab import ShardLabStrategy

    setting, world = SETTINGS["default"], int(os.environ["WORLD_SIZE"])
    strategy = ShardLabStrategy(stage=int(variant[-1])) if variant.startswith("shardlab") else variant
    profile, times = cProfile.Profile(), []

    class Profiled(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
            self.started = time.perf_counter()
            if trainer.global_step == warmup:
                profile.enable()

        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            times.append(time.perf_counter() - self.started)

    tokens = _tokens(setting, warmup + steps, world)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    trainer = timing_trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=warmup + steps, callbacks=[Profiled()]
    )
    trainer.fit(_model(setting), loader)
    profile.disable()
    parts = dict.fromkeys(PARTS, 0.0)
    for (path, _, func), (_, _, own, cumulative, _) in pstats.Stats(profile).stats.items():
        if "torch/optim" in path and func.startswith(UPDATES):  # its kernels are built-ins it calls
            parts["optimizer update"] += cumulative / steps
        elif (part := _part(path, func)) is not None:
            parts[part] += own / steps
    return {"parts": parts, "profiled_step": statistics.median(times[warmup:])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="1 repeat, printed; RESULTS.md untouched")
    args = p.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            runs[variant].append(
                run_ranks(profiled_rank, 2, {"variant": variant, "warmup": args.warmup, "steps": args.steps})[0]
            )
    text = report(runs, args)
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "step_profile", text)


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def ms(variant: str, part: str) -> float:
        return 1000 * statistics.median(r["parts"][part] for r in runs[variant])

    rows = [
        f"| {part} | "
        + " | ".join(f"{ms(v, part):.1f}" for v in VARIANTS)
        + f" | {ms(VARIANTS[-1], part) - ms('ddp', part):+.1f} |"
        for part in PARTS
    ]
    steps = " | ".join(f"{1000 * statistics.median(r['profiled_step'] for r in runs[v]):.0f}" for v in VARIANTS)
    return "\n".join(
        [
            "<!-- step_profile: begin -->",
            "## Where a step's main-thread time goes (profiled)",
            "",
            f"Command: `python -m benchmarks.step_profile --repeats {args.repeats} --warmup {args.warmup} --steps"
            f" {args.steps}` ({datetime.date.today()}; `nproc` {os.cpu_count()}, {platform.processor() or 'cpu'}, torch"
            f" {torch.__version__}). bench.py's default GPT on 2 CPU ranks, rank 0's own time per step under"
            " `cProfile`, medians over repeats (benchmarks/step_profile.py says what each part holds).",
            "",
            "| ms per step | " + " | ".join(VARIANTS) + " | stage 3 - ddp |",
            "| --- | " + " | ".join("---" for _ in VARIANTS) + " | --- |",
            *rows,
            f"| profiled step (all of it) | {steps} | |",
            "<!-- step_profile: end -->",
        ]
    )


if __name__ == "__main__":
    main()
