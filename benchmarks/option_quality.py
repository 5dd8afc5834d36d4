"""Does it still train? The README's fine-tune with each fewer-bytes option, against the exact run.

    python -m benchmarks.option_quality            # the full recipe: a pretraining, 6 fine-tunes; ~15 min on 2 cores
    python -m benchmarks.option_quality --quick    # tiny sizes (a few minutes, mostly the launches' start-up)

The options that send fewer bytes (``reduce_dtype``, ``gather_dtype``) change what each step computes with, so
fewer bytes only pay if training still ends where the exact run ends. Each option runs as the README runs the
example: its own 2-rank launch of ``python -m lightning_shardlab.examples.finetune`` (one thread per rank), with
the flag passed. All launches fine-tune one pretrained checkpoint with the same seeds, and the first launch
(the exact run) writes that checkpoint. Each launch's ``finetune.json`` gives its validation perplexity before
and after, and its logged loss rows. The figure of merit is the final perplexity over the exact run's (the goal:
within 1 %). The wire bytes per step come from the launch's budget (rank 0's ledger). Writes
``benchmarks/OPTION_QUALITY.md``, whose table the manual includes (docs/slow_links.md),
``benchmarks/OPTION_QUALITY.png`` (the loss curves of all options in one figure), and
``benchmarks/OPTION_QUALITY.json`` (the figures both are made of, loss rows included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks.bench import machine
from benchmarks.ranks import free_port
from benchmarks.sections import snippet_markers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTION = "option_quality"  # the manual includes the table by this name
GOAL = 0.01  # final perplexity within 1 % of the exact run's
OPTIONS: dict[str, list[str]] = {  # name -> the fine-tune's flags; the first is the reference
    "exact": [],
    "reduce_bf16": ["--reduce-dtype", "bf16"],
    "reduce_fp16": ["--reduce-dtype", "fp16"],
    "reduce_int8": ["--reduce-dtype", "int8"],
    "gather_int8": ["--gather-dtype", "int8"],
    "gather_int8_reduce_int8": ["--gather-dtype", "int8", "--reduce-dtype", "int8"],
}
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def finetune_command(runs: Path, name: str, quick: bool, steps: int | None) -> list[str]:
    """The README's command with option ``name``'s flags; every option shares ``runs``' pretrained checkpoint."""
    command = [sys.executable, "-m", "lightning_shardlab.examples.finetune", "--runs", str(runs)]
    command += ["--quick"] * quick + ["--finetune-steps", str(steps)] * (steps is not None)
    return command + ["--finetune-dir", str(option_dir(runs, name, quick)), *OPTIONS[name]]


def option_dir(runs: Path, name: str, quick: bool) -> Path:
    return (runs / "quick" if quick else runs) / name


def launch(command: list[str], log: Path, timeout: float) -> float:
    """Run one fine-tune (it starts its second rank itself); its output goes to ``log``. Seconds taken."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore", COLUMNS="160")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}; its output: {log}")
    return time.perf_counter() - start


def collect(folder: Path, quick: bool) -> dict:
    """One launch's figures: its finetune.json, its logged loss rows, rank 0's wire bytes per step, and the
    perplexity of the weights it saved."""
    from lightning_shardlab.examples.finetune import loss_rows

    result = json.loads((folder / "finetune.json").read_text())
    metrics_csv = Path(result.pop("metrics_csv"))  # a scratch path: not kept
    (budget, *_) = json.loads((metrics_csv.parent / "shardlab_budget.json").read_text())
    result["bytes_per_step"] = sum(kind["bytes"] for kind in budget["comm_per_step"].values())
    result["saved_perplexity"] = saved_perplexity(folder / "gpt.ckpt", quick)
    return result | {"losses": loss_rows(metrics_csv)}


def saved_perplexity(checkpoint: Path, quick: bool) -> float:
    """Validation perplexity of the saved full weights (the fp32 masters), in this process, every weight exact.

    Int8 gathers round the weights each forward computes with, the launch's last validation included; this
    figure tells where training ended apart from that rounding. The whole validation split, each block once.
    """
    import torch
    from torchmetrics.text import Perplexity

    from lightning_shardlab.examples.finetune import FULL, QUICK, data_for
    from lightning_shardlab.examples.gpt import GPT

    recipe = QUICK if quick else FULL
    data = data_for(recipe, "python_topics")
    data.setup("validate")
    model, perplexity = GPT(**recipe.model, init_from=str(checkpoint)).eval(), Perplexity()
    with torch.no_grad():
        for x, y in data.val_dataloader():
            perplexity.update(model(x), y)
    return perplexity.compute().item()


def table(results: dict[str, dict]) -> list[str]:
    """The markdown table: each option's perplexity before and after fine-tuning, and after against the exact
    run's (the first entry); within the goal when |after / exact - 1| <= GOAL."""
    exact = next(iter(results.values()))
    lines = [
        "| option | flags | val perplexity before | val perplexity after | after / exact | within 1 % "
        "| saved weights, exact forward (/ exact) | wire bytes/step (vs exact) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        ratio = r["perplexity_after"] / exact["perplexity_after"]
        flags = " ".join(OPTIONS.get(name, [])) or "(defaults)"
        saved = f"{r['saved_perplexity']:.3f} ({r['saved_perplexity'] / exact['saved_perplexity']:.4f})"
        bytes_ = f"{r['bytes_per_step'] / 1e6:.2f} MB ({r['bytes_per_step'] / exact['bytes_per_step']:.2f})"
        lines.append(
            f"| {name} | `{flags}` | {r['perplexity_before']:.3f} | {r['perplexity_after']:.3f} | {ratio:.4f} "
            f"| {'yes' if abs(ratio - 1) <= GOAL else f'**no** ({100 * (ratio - 1):+.2f} %)'} | {saved} | {bytes_} |"
        )
    return lines


def reading(results: dict[str, dict]) -> list[str]:
    """What the table says, from its own numbers: which options meet the goal, and the worst miss."""
    exact = next(iter(results.values()))["perplexity_after"]
    off = {name: r["perplexity_after"] / exact - 1 for name, r in results.items()}
    missed = [name for name, d in off.items() if abs(d) > GOAL]
    worst = max(off, key=lambda name: abs(off[name]))
    if not missed:
        return [f"Every option ends within 1 % of the exact run; the farthest is {worst} ({100 * off[worst]:+.3f} %)."]
    named = ", ".join(f"{name} ({100 * off[name]:+.2f} %)" for name in missed)
    return [f"Missed the 1 % goal: {named}."]


def plot(results: dict[str, dict], png: Path, title: str) -> None:
    """Train loss of every option (lines) and its val loss (points); below, each train loss minus the exact's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {name: r["losses"] for name, r in results.items()}
    exact = {step: value for step, value in next(iter(rows.values()))["train_loss"]}
    fig, (losses, diffs) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    for i, (name, points) in enumerate(rows.items()):
        color = f"C{i}"
        losses.plot(*zip(*points["train_loss"]), "-", color=color, lw=1, label=f"{name} train")
        losses.plot(*zip(*points["val_loss"]), "o", color=color, mfc="none", label=f"{name} val")
        diff = [(step, value - exact[step]) for step, value in points["train_loss"] if step in exact]
        diffs.plot(*zip(*diff), "-", color=color, lw=1, label=name)
    losses.set(ylabel="cross-entropy (nats per byte)", title=title)
    losses.legend(ncol=2, fontsize=7)
    diffs.axhline(0, color="black", lw=0.5)
    diffs.set(xlabel="optimizer step", ylabel="train loss - exact's")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, dict], args: argparse.Namespace, seconds: float, out: Path) -> None:
    command = "python -m benchmarks.option_quality" + " --quick" * args.quick
    command += f" --finetune-steps {args.finetune_steps}" * (args.finetune_steps is not None)
    exact = next(iter(results.values()))
    start, stop = snippet_markers(SECTION)
    lines = [
        "# Does it still train? The example fine-tune with each fewer-bytes option",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min), {date.today().isoformat()}.  ",
        f"Machine: {machine()}; 2 ranks, 1 thread each (gloo), as the README runs the example.  ",
        f"Fine-tune: {exact['steps']} steps at stage 3 from one pretrained checkpoint, the same seeds for every "
        "option; perplexity over the whole validation split, after the last step. Each option is its own launch "
        "of `python -m lightning_shardlab.examples.finetune` with the flags shown.",
        "",
        start,
        *table(results),
        "",
        *reading(results),
        stop,
        "",
        "Saved weights, exact forward: the perplexity of the fp32 weights the launch saved, computed in one "
        "process with every weight exact (no int8 rounding) over the whole validation split, each block once. "
        "Wire bytes/step: rank 0's ledger, every collective of a training step (the budget's `comm_per_step`). "
        f"Loss curves: `{out.with_suffix('.png').name}` (top: train loss lines, val loss points; bottom: each "
        "train loss minus the exact run's at the same step).",
    ]
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the example's tiny sizes (a few minutes)")
    parser.add_argument("--finetune-steps", type=int, help="fewer fine-tune steps than the recipe's")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "option_quality"), help="scratch folder (wiped)")
    parser.add_argument("--out", default=str(HERE / "OPTION_QUALITY.md"), help="the report; the PNG sits beside it")
    args = parser.parse_args(argv)
    runs, out = Path(args.runs).resolve(), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(runs / "quick" if args.quick else runs, ignore_errors=True)  # pretrain once, in this invocation
    start, results = time.perf_counter(), {}
    for name in OPTIONS:
        folder = option_dir(runs, name, args.quick)
        seconds = launch(finetune_command(runs, name, args.quick, args.finetune_steps), folder / "output.txt", 1800)
        results[name] = collect(folder, args.quick)
        after = results[name]["perplexity_after"]
        print(f"{name}: perplexity after {after:.4f} ({seconds:.0f} s)", flush=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")  # what the report is made of
    title = f"fine-tune with each fewer-bytes option, stage 3, 2 CPU ranks{' (--quick)' * args.quick}"
    plot(results, out.with_suffix(".png"), title)
    write_report(results, args, time.perf_counter() - start, out)
    print("\n".join(table(results) + reading(results)), f"\nwrote {out} and {out.with_suffix('.png')}", sep="\n")


if __name__ == "__main__":
    main()
