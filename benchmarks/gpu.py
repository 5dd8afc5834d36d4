"""The GPU checks, as one prepared script for a machine with a CUDA device (about 10 minutes on one GPU).

    python -m benchmarks.gpu --out DIR           # writes DIR/gpu.json and DIR/GPU.md
    python -m benchmarks.gpu --device cpu --size tiny --steps 3 --warmup 1   # the same code, a dry run on CPU

The parts, in the order they run (``--only PART`` runs one, repeatable); GPU.md and gpu.json are written after each,
so a run cut short keeps what it measured:

1. ``tests``: the ``gpu``-marked tests (tests/test_gpu.py), first: one rank, two ranks and a 2x2 hybrid layout of four
   sharing the GPU against the unsharded reference, Muon/Adafactor and fp16's loss scale against Lightning's DDP
   sharing the GPU too, cpu offload, the device's clock in the time side, no synchronising CUDA call in a steady step
   (``torch.cuda.set_sync_debug_mode``), NCCL alone on the GPU issuing real collectives; cut off after
   ``--tests-timeout`` seconds.
2. ``overhead``: world size 1, steps per second of the example GPT under plain Lightning (``strategy="auto"``) and
   under ``ShardLabStrategy`` on one device, interleaved; target >= 0.98x.
3. ``mfu``: model FLOPs utilisation, GPT-2 small shapes (124M parameters, 1024 tokens) with ``bf16-mixed`` under
   shardlab on one GPU; MFU = 6 N + 12 L T d flops per token (nanoGPT's estimate, N without the position
   embedding) times tokens per second, over the device's dense bf16 peak (``--peak-tflops``, default the
   H200's 989); target >= 30%.
4. ``overlap``, with 2 GPUs or more: stages 1-3 on 2 ranks with a GPU each (NCCL), 3 steps under torch.profiler; per
   collective kind, the fraction of NCCL's kernel time under compute kernels, read from the trace
   (``lightning_shardlab/budget/measured/kernel_overlap.py``). One GPU has no NCCL kernel to overlap (ranks sharing
   it talk over gloo through host memory; a world of one issues no collectives): the row says so.
5. ``cpu_offload``: the same GPT-2 shapes in ``bf16-mixed`` with masters and AdamW state in host memory, against no
   offload, interleaved: seconds per step and the device's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.ranks import timing_trainer

SIZES = {  # GPT-2 small's shapes; tiny for a dry run on CPU
    "gpt2": {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768, "batch": 8},
    "tiny": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64, "batch": 4},
}


def flops_per_token(n_params: int, size: dict) -> int:
    """Forward and backward: 6 per parameter per token, plus attention's 12 L T d (nanoGPT, PaLM appendix B)."""
    return 6 * n_params + 12 * size["n_layer"] * size["block_size"] * size["n_embd"]


def gpt_and_batches(size: dict, batches: int) -> tuple:
    """The example GPT at ``size`` (seeded) and a loader of ``batches`` random batches."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_shardlab.examples.gpt import GPT

    torch.manual_seed(0)
    keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    model = GPT(**{k: size[k] for k in keys}, lr=1e-4, warmup_steps=0)
    tokens = torch.randint(0, size["vocab_size"], (batches * size["batch"], size["block_size"] + 1))
    return model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=size["batch"])


def timed_fit(
    strategy: str, size: dict, device: str, precision: str, warmup: int, steps: int, offload: str = "none"
) -> dict:
    """Seconds per step of one fit of the example GPT on one device, after ``warmup`` steps, and the device's
    peak allocated bytes."""
    import lightning as L

    from lightning_shardlab import ShardLabStrategy

    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
            if device == "cuda":
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    model, loader = gpt_and_batches(size, warmup + steps)
    trainer = timing_trainer(
        accelerator=device,
        devices=1,
        precision=precision,
        max_steps=warmup + steps,
        strategy=ShardLabStrategy(offload=offload) if strategy == "shardlab" else "auto",
        callbacks=[Clock()],
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, loader)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"seconds": statistics.median(times[warmup:]), "params": n_params, "device_peak": peak}


def overhead(size: dict, device: str, precision: str, warmup: int, steps: int, repeats: int) -> dict:
    runs = {"auto": [], "shardlab": []}
    for _ in range(repeats):  # interleaved
        for strategy in runs:
            runs[strategy].append(timed_fit(strategy, size, device, precision, warmup, steps)["seconds"])
    plain, ours = statistics.median(runs["auto"]), statistics.median(runs["shardlab"])
    return {"plain_steps_per_s": 1 / plain, "shardlab_steps_per_s": 1 / ours, "ratio": plain / ours, "runs": runs}


def cpu_offload(size: dict, warmup: int, steps: int, repeats: int) -> dict:
    """offload='cpu' against 'none' on one GPU, bf16-mixed, interleaved: s/step and peak device memory."""
    runs: dict[str, list[dict]] = {"none": [], "cpu": []}
    for _ in range(repeats):
        for offload in runs:
            runs[offload].append(timed_fit("shardlab", size, "cuda", "bf16-mixed", warmup, steps, offload))
    seconds = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    peak = {k: max(r["device_peak"] for r in v) for k, v in runs.items()}
    return {"seconds": seconds, "device_peak": peak, "ratio": seconds["cpu"] / seconds["none"]}


def mfu(size: dict, device: str, warmup: int, steps: int, peak_tflops: float) -> dict:
    run = timed_fit("shardlab", size, device, "bf16-mixed", warmup, steps)
    tokens_per_s = size["batch"] * size["block_size"] / run["seconds"]
    achieved = flops_per_token(run["params"], size) * tokens_per_s
    return {
        "params": run["params"],
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": achieved / (peak_tflops * 1e12),
    }


def profiled_overlap(size: dict, device: str, world: int, stage: int, warmup: int, steps: int, out: str) -> dict:
    """One rank of ``world``, a device each (NCCL on GPUs): the example GPT at ``stage``, ``steps`` steps after
    ``warmup`` under torch.profiler; each collective kind's kernel time under compute kernels, from its trace
    (budget/measured/kernel_overlap.py; a CPU run's trace has no kernels)."""
    import lightning as L

    from lightning_shardlab import ShardLabStrategy
    from lightning_shardlab.budget.measured.kernel_overlap import overlap_in_trace

    rank = int(__import__("os").environ["RANK"])
    trace = Path(out) / f"overlap_stage{stage}_rank{rank}.trace.json"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] * (device == "cuda"))

    class Profile(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == warmup:
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == warmup + steps - 1:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                self.profiler.export_chrome_trace(str(trace))

    model, loader = gpt_and_batches(size, world * (warmup + steps))  # each rank its own (the distributed sampler)
    precision = "bf16-mixed" if device == "cuda" else "32-true"
    trainer = timing_trainer(
        accelerator=device, devices=world, precision=precision, max_steps=warmup + steps,
        strategy=ShardLabStrategy(stage=stage), callbacks=[Profile()],
    )  # fmt: skip
    trainer.fit(model, loader)
    return overlap_in_trace(trace)


def overlap(size: dict, device: str, warmup: int, steps: int) -> dict:
    """Stages 1-3 on 2 ranks with a GPU each: per stage and kind, the fraction of NCCL's kernel time under compute
    (the mean over ranks). Needs 2 GPUs: ranks sharing one GPU talk over gloo through host memory, and a world of
    one issues no collectives, so one GPU has no NCCL kernel to overlap."""
    import tempfile

    from benchmarks.ranks import run_ranks

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    by_stage, out = {}, tempfile.mkdtemp(prefix="shardlab-overlap-")  # the traces: tens of MB on a GPU
    for stage in (1, 2, 3):
        kwargs = {"size": size, "device": device, "world": 2, "stage": stage, "warmup": warmup, "steps": steps}
        ranks = run_ranks(profiled_overlap, 2, {**kwargs, "out": out})
        kinds = sorted({kind for r in ranks for kind in r})
        by_stage[stage] = {
            k: {x: statistics.mean(r[k][x] for r in ranks if k in r) for x in ("seconds", "hidden", "fraction")}
            for k in kinds
        }
    return by_stage


PARTS = ("tests", "overhead", "mfu", "overlap", "cpu_offload")


def gpu_tests(timeout: float) -> dict:
    """tests/test_gpu.py in a pytest of its own, cut off after ``timeout`` seconds; its summary, and the tail of
    its output (the failures' short summary) in gpu.json."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        code, output = proc.returncode, proc.stdout + proc.stderr
        lines = proc.stdout.strip().splitlines()
        summary = lines[-1] if lines else proc.stderr[-300:]
    except subprocess.TimeoutExpired as cut:
        code, output = None, (cut.stdout or b"").decode(errors="replace")
        summary = f"cut off after {timeout:.0f} s"
    return {"returncode": code, "seconds": time.perf_counter() - started, "summary": summary, "tail": output[-6000:]}


def _overlap_cell(results: dict) -> str:
    by_stage = results["overlap"]
    if "skipped" in by_stage:
        return f"not run: {by_stage['skipped']}"
    parts = []
    for stage, kinds in by_stage.items():
        shown = ", ".join(f"{k} {100 * v['fraction']:.0f}% of {1e3 * v['seconds']:.1f} ms" for k, v in kinds.items())
        parts.append(f"stage {stage}: {shown or 'no communication kernels'}")
    return "; ".join(parts)


def report(results: dict, out: Path) -> str:
    """GPU.md and gpu.json in ``out``, from the parts run so far (written after each part: a run cut short keeps
    what it measured)."""
    lines = [
        "# GPU checks",
        "",
        f"Command: `python -m benchmarks.gpu` on {results['device_name']}, torch {torch.__version__}.",
        "",
        "| check | target | this run |",
        "| --- | --- | --- |",
    ]
    if "tests" in results:
        t = results["tests"]
        lines.append(f"| tests/test_gpu.py | pass | {t['summary']} ({t['seconds']:.0f} s) |")
    if "overhead" in results:
        o = results["overhead"]
        lines.append(
            f"| world size 1: shardlab / plain Lightning steps per second ({results['overhead_precision']}) | >= 0.98 "
            f"| {o['ratio']:.3f} ({o['shardlab_steps_per_s']:.2f} vs {o['plain_steps_per_s']:.2f}) |"
        )
    if "mfu" in results:
        m = results["mfu"]
        lines.append(
            f"| GPT-2 {m['params'] / 1e6:.0f}M bf16-mixed MFU (peak {results['peak_tflops']} TFLOP/s) | >= 30% "
            f"| {100 * m['mfu']:.1f}% ({m['tflops']:.1f} TFLOP/s, {m['tokens_per_s']:.0f} tokens/s) |"
        )
    if "cpu_offload" in results:
        c = results["cpu_offload"]
        lines.append(
            f"| offload='cpu' / none, s/step (GPT-2 bf16-mixed) | measured | {c['ratio']:.3f}"
            f" ({c['seconds']['cpu']:.4f} vs {c['seconds']['none']:.4f} s) |"
        )
        lines.append(
            f"| peak device memory, offload='cpu' vs none | lower | {c['device_peak']['cpu'] / 2**30:.2f} GiB vs"
            f" {c['device_peak']['none'] / 2**30:.2f} GiB |"
        )
    if "overlap" in results:
        lines.append(
            f"| NCCL kernel time under compute, 2 ranks with a GPU each | measured | {_overlap_cell(results)} |"
        )
    text = "\n".join(lines) + "\n"
    (out / "GPU.md").write_text(text)
    (out / "gpu.json").write_text(json.dumps(results, indent=1))
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--size", default="gpt2", choices=tuple(SIZES))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    p.add_argument("--only", action="append", choices=PARTS, help="run this part only (repeatable)")
    p.add_argument("--tests-timeout", type=float, default=420.0, help="seconds for tests/test_gpu.py")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks.gpu: no CUDA device here. HINT: run it on a GPU machine, or --device cpu for a dry run."
        )
    size, out = SIZES[args.size], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    cuda = args.device == "cuda"
    parts = {  # the checks first, then the figures
        "tests": (lambda: gpu_tests(args.tests_timeout)) if cuda else None,
        "overhead": lambda: overhead(size, args.device, precision, args.warmup, args.steps, args.repeats),
        "mfu": lambda: mfu(size, args.device, args.warmup, args.steps, args.peak_tflops),
        "overlap": lambda: overlap(size, args.device, args.warmup, min(args.steps, 3)),
        "cpu_offload": (lambda: cpu_offload(size, args.warmup, args.steps, args.repeats)) if cuda else None,
    }
    results = {
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "peak_tflops": args.peak_tflops,
        "size": size,
        "overhead_precision": precision,
    }
    for name, run in parts.items():
        if run is not None and (not args.only or name in args.only):
            results[name] = run()
            report(results, out)
    print(report(results, out))


if __name__ == "__main__":
    main()
