"""The training stall per checkpoint save, synchronous against ``async_save=True``.

    python -m benchmarks.async_save                                   # the 14M GPT of benchmarks/bench.py
    python -m benchmarks.async_save --setting tiny --repeats 1 --saves 2 --out /tmp/async_smoke.md

2 CPU ranks, one thread each (gloo), fp32 AdamW, stage 3. Each run trains ``--saves`` x 2 steps and saves a
sharded checkpoint (to the same path: each save replaces the last) after every second step. The stall is
how long ``trainer.save_checkpoint`` keeps rank 0 from its next step (its median over the saves); the step
time is the median of the steps, so the cost of a write going on behind training shows there; the wall
time covers the whole fit, the last save's completion at the end of fit included. The model file's part of each
save (rank 0 writing it with its holes, and rank 0 writing its slices of the parameters into it:
checkpoint/model_file.py) is timed on its own, and the bytes on disk are split between the model file and the
shards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench import SETTINGS, _model, _tokens, machine
from benchmarks.ranks import interleaved, run_ranks, save_report, timed, timing_trainer

WORLD = 2
VARIANTS = {"sync": False, "async": True}


def run_rank(variant: str, setting_name: str, saves: int, directory: str) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab import ShardLabStrategy
    from lightning_shardlab.checkpoint import model_file
    from lightning_shardlab.checkpoint.format import shards_of

    setting, stalls, steps, model_file_seconds = SETTINGS[setting_name], [], [], []

    model_file.write_skeleton = timed(model_file.write_skeleton, model_file_seconds.append)
    model_file.write_slices = timed(model_file.write_slices, model_file_seconds.append)

    class SaveEveryOther(L.Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
            steps.append(time.perf_counter() - self.t)
            if batch_idx % 2 == 1:
                started = time.perf_counter()
                trainer.save_checkpoint(f"{directory}/ckpt")
                stalls.append(time.perf_counter() - started)

    tokens = _tokens(setting, 2 * saves, WORLD)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=setting["batch"])
    strategy = ShardLabStrategy(stage=3, async_save=VARIANTS[variant])
    trainer = timing_trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=2 * saves, callbacks=[SaveEveryOther()]
    )
    started = time.perf_counter()
    trainer.fit(_model(setting), loader)
    wall = time.perf_counter() - started
    path = Path(f"{directory}/ckpt")
    shards = sum(f.stat().st_size for f in shards_of(path).iterdir())
    per_save = sum(model_file_seconds) / saves
    return {"stalls": stalls, "steps": steps[1:], "wall": wall, "bytes": shards + path.stat().st_size,
            "model_file_bytes": path.stat().st_size, "model_file_seconds": per_save}  # fmt: skip


def sample(variant: str, setting: str, saves: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        ranks = run_ranks(run_rank, WORLD, {"variant": variant, "setting_name": setting, "saves": saves,
                                            "directory": directory})  # fmt: skip
    return ranks[0]


def report(samples: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def med(variant: str, key: str) -> float:
        return statistics.median(statistics.median(s[key]) for s in samples[variant])

    walls = {v: statistics.median(s["wall"] for s in samples[v]) for v in samples}
    rows = [
        f"| {v} | {med(v, 'stalls'):.4f} | {med(v, 'steps'):.4f} | {walls[v]:.2f} "
        f"| {samples[v][0]['bytes'] / 1e6:.1f} MB | {samples[v][0]['model_file_bytes'] / 1e6:.1f} MB "
        f"| {statistics.median(s['model_file_seconds'] for s in samples[v]):.4f} |"
        for v in samples
    ]
    stall_ratio = med("async", "stalls") / med("sync", "stalls")
    return "\n".join(
        [
            "# Checkpoint saves: the stall, synchronous and in the background",
            "",
            f"Command: `python -m benchmarks.async_save --setting {args.setting} --repeats {args.repeats} --saves "
            f"{args.saves} --out {args.out}`",
            "",
            f"Machine: {machine()}. {WORLD} ranks, 1 thread each (gloo), fp32 AdamW, stage 3; a save after every"
            f" second step, {args.saves} saves per run, {args.repeats} interleaved repeats (medians).",
            "",
            "| saves | stall per save (s) | step (s) | whole fit (s) | checkpoint | of which the model file |"
            " model file's writing per save, rank 0 (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            f"Stall with `async_save=True` / synchronous: {stall_ratio:.3f}. The stall left is the plan (one small"
            " all-gather), the copy of each rank's shards into host memory and the previous save's completion; the"
            " files are written while training goes on, so on a machine with spare cores and disk bandwidth the"
            " step time hides it (on this 2-core box the write competes with the two ranks for the cores).",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.async_save", description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=tuple(SETTINGS), default="default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--out", default="benchmarks/ASYNC_SAVE.md")
    args = p.parse_args(argv)
    samples = interleaved(VARIANTS, args.repeats, lambda v: sample(v, args.setting, args.saves))
    save_report(args.out, samples, report(samples, args))


if __name__ == "__main__":
    main()
