"""Fine-tune a small GPT fully sharded (ZeRO stage 3) on 2 CPU ranks, and show what it costs.

    python -m lightning_shardlab.examples.finetune            # a few minutes on a 2-core machine
    python -m lightning_shardlab.examples.finetune --quick    # tiny sizes, seconds (the tests run this)
    python -m lightning_shardlab.examples.finetune --reduce-dtype int8 --finetune-dir runs/finetune_int8

The fewer-bytes flags (``--reduce-dtype``, ``--gather-dtype``, ``--quant-block-size``) reach the fine-tune's
strategy only: the pretraining stays exact, so every variant starts from the same checkpoint.
``benchmarks/option_quality.py`` runs each of them against the exact fine-tune.

1. Pretrain (only if ``runs/pretrain/gpt.ckpt`` does not exist yet): a byte-level GPT learns the
   docstrings of the Python standard library, sharded at stage 2; saved as a plain, full checkpoint.
2. Fine-tune it on the Python documentation's help topics, fully sharded (stage 3): validation
   perplexity and generated samples before and after, the budget tables, ``runs/finetune/loss.png``, and
   the vital signs dashboard of every rank, ``runs/finetune/vitals/vitals.html``, and ``runs/finetune/finetune.json``
   (perplexity before and after, the strategy options, where the logged loss rows are).

Lightning's launcher starts the second rank by running this same script again, so every rank executes
``main`` from the top: every rank builds the same models and calls every collective (validate, fit,
generate, save) in the same order. Only printing is left to rank 0.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_shardlab import ShardLabBudget, ShardLabStrategy, ShardLabVitals
from lightning_shardlab.examples.gpt import GPT, Block
from lightning_shardlab.examples.text import TextDataModule, decode, encode

PROMPTS = ('The "while" statement\n', "Boolean operations\n", "A class definition ")


@dataclass(frozen=True)
class Recipe:
    """Sizes and step counts of one run of this script."""

    model: dict = field(default_factory=lambda: dict(n_layer=4, n_head=4, n_embd=128, block_size=128))
    batch_size: int = 16  # per rank
    pretrain_steps: int = 450
    finetune_steps: int = 250
    pretrain_lr: float = 3e-3
    finetune_lr: float = 2e-3
    val_every: int = 50  # training steps between validations (the val_loss points on the loss plot)
    val_batches: float | int = 1.0  # per rank (Trainer's limit_val_batches)
    new_tokens: int = 160  # generated per sample


FULL = Recipe()
QUICK = Recipe(
    model=dict(n_layer=4, n_head=2, n_embd=32, block_size=32),  # 4 blocks: stage 3 gathers 2 at a time
    batch_size=8,
    pretrain_steps=24,
    finetune_steps=20,
    pretrain_lr=3e-3,
    finetune_lr=3e-3,
    val_every=8,
    val_batches=4,
    new_tokens=24,
)


@rank_zero_only
def report(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


RANKS = 2


def make_strategy(stage: int, **options: Any) -> ShardLabStrategy:
    """The example's strategy at ``stage``, with any further strategy ``options`` (the fewer-bytes ones)."""
    # unit_classes=[Block]: one unit per transformer block, so stage 3 gathers one block at a time (the budget's
    # "units:" line says so). The default would merge these small blocks into one bucket, a unit the size of
    # the model: right for speed at this size, but it would show nothing of per-unit gathering.
    return ShardLabStrategy(stage=stage, state_dict_type="full", unit_classes=[Block], **options)


def make_trainer(
    recipe: Recipe, stage: int, steps: int, data: TextDataModule, logs: Path, *callbacks: L.Callback, **options: Any
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=make_strategy(stage, **options),
        max_steps=steps,
        max_epochs=-(-steps // data.batches_per_epoch(RANKS)),  # the progress bar's total: the epochs max_steps spans
        val_check_interval=min(recipe.val_every, steps),
        limit_val_batches=recipe.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        enable_checkpointing=False,
        logger=CSVLogger(logs, name="logs"),
        callbacks=[ShardLabBudget(timeline=True), *callbacks],
    )


def data_for(recipe: Recipe, source: str) -> TextDataModule:
    return TextDataModule(source=source, block_size=recipe.model["block_size"], batch_size=recipe.batch_size)


def perplexity(trainer: L.Trainer, model: GPT, data: TextDataModule) -> float:
    """Validation perplexity over all ranks' shares of the validation text (runs sharded).

    Lightning's DistributedSampler repeats up to one block per rank to give every rank the same count.
    """
    return trainer.validate(model, datamodule=data, verbose=False)[0]["val_ppl"]


def samples(model: GPT, new_tokens: int) -> list[str]:
    """One seeded sample per prompt. Collective under stage 3: every rank must run it, identically."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(1234)  # the same draws before and after fine-tuning
    out = []
    for prompt in PROMPTS:
        idx = encode(prompt).long()[None]  # (1, t)
        idx = model.generate(idx, new_tokens, temperature=0.8, top_k=40, generator=generator)  # (1, t + new)
        out.append(decode(idx[0]))
    model.train(was_training)
    return out


def save_full_checkpoint(trainer: L.Trainer, path: Path) -> None:
    """Collective: rank 0 writes a plain Lightning checkpoint (loadable without this package), atomically."""
    partial = path.with_name(path.name + ".partial")
    trainer.save_checkpoint(partial, weights_only=False)  # with optimizer state: resumable
    if trainer.global_rank == 0:
        partial.replace(path)
    trainer.strategy.barrier()


def show_samples(title: str, texts: list[str]) -> None:
    report(f"\n--- samples {title} ---", *(f"[{i}] " + text.replace("\n", "\n    ") for i, text in enumerate(texts)))


def pretrain(recipe: Recipe, ckpt: Path) -> None:
    report(f"\n=== 1. pretraining on stdlib docstrings (stage 2, 2 ranks) -> {ckpt} ===")
    model = GPT(**recipe.model, lr=recipe.pretrain_lr)
    data = data_for(recipe, "stdlib_docstrings")
    report(f"data: {data.fingerprint()}")
    trainer = make_trainer(recipe, 2, recipe.pretrain_steps, data, ckpt.parent)
    trainer.fit(model, datamodule=data)
    report(f"pretrained: validation perplexity on stdlib docstrings {perplexity(trainer, model, data):.2f}")
    save_full_checkpoint(trainer, ckpt)


def finetune(recipe: Recipe, init_from: Path, out: Path, **options: Any) -> tuple[float, float]:
    """Fine-tune at stage 3 with the strategy ``options`` (none: every collective exact); perplexity before, after."""
    where = f"from {init_from}" + "".join(f", {k}={v!r}" for k, v in options.items())
    report(f"\n=== 2. fine-tuning on python help topics, fully sharded (stage 3, 2 ranks), {where} ===")
    model = GPT(
        **recipe.model, lr=recipe.finetune_lr, warmup_steps=recipe.finetune_steps // 10, init_from=str(init_from)
    )
    data = data_for(recipe, "python_topics")
    report(f"data: {data.fingerprint()}")
    vitals = ShardLabVitals(every_n_steps=5, dashboard_dir=str(out / "vitals"))  # every rank's signs, overlaid
    trainer = make_trainer(recipe, 3, recipe.finetune_steps, data, out, vitals, **options)
    before = perplexity(trainer, model, data)
    show_samples("before fine-tuning", samples(model, recipe.new_tokens))
    fit_start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_seconds = time.perf_counter() - fit_start
    after = perplexity(trainer, model, data)
    show_samples("after fine-tuning", samples(model, recipe.new_tokens))
    report(f"\nvalidation perplexity on python help topics: before {before:.2f} -> after {after:.2f}")
    save_full_checkpoint(trainer, out / "gpt.ckpt")
    if trainer.global_rank == 0:
        metrics_csv = Path(trainer.logger.log_dir) / "metrics.csv"
        plot_losses(metrics_csv, out / "loss.png")
        report(f"vital signs of every rank (dashboard): {vitals.paths.get('html', 'not written')}")
        summary = dict(
            perplexity_before=before, perplexity_after=after, options=options, steps=recipe.finetune_steps,
            fit_seconds=fit_seconds, metrics_csv=str(metrics_csv),
        )  # fmt: skip
        (out / "finetune.json").write_text(json.dumps(summary, indent=1) + "\n")
    return before, after


def loss_rows(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """The logged ``train_loss`` and ``val_loss`` points of one run, as (optimizer step, value) in logged order."""
    rows = list(csv.DictReader(metrics_csv.read_text().splitlines()))  # one row per logging call
    return {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)] for key in ("train_loss", "val_loss")}


def plot_losses(metrics_csv: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report("no loss plot: matplotlib is not installed. HINT: pip install 'lightning-shardlab[plot]'")
        return
    points_by_key = loss_rows(metrics_csv)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = points_by_key[key]
        if points:
            ax.plot(*zip(*points), style, label=key)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title="fine-tune, stage 3, 2 CPU ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    report(f"loss curve: {png}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (seconds; for tests)")
    parser.add_argument("--runs", default="runs", help="output folder (default: ./runs)")
    parser.add_argument("--finetune-dir", help="the fine-tune's output folder (default: RUNS/finetune)")
    parser.add_argument("--finetune-steps", type=int, help="fine-tune steps (default: the recipe's, 250; 20 quick)")
    fewer = parser.add_argument_group("fewer bytes, for the fine-tune only (default: every collective exact)")
    fewer.add_argument("--reduce-dtype", choices=("bf16", "fp16", "int8"), help="gradients' reduce-scatter dtype")
    fewer.add_argument("--gather-dtype", choices=("int8",), help="weights' all-gathers as int8 blocks (stage 3)")
    fewer.add_argument("--quant-block-size", type=int, help="elements per scale of the int8 blocks (default: 2048)")
    args = parser.parse_args(argv)
    if args.finetune_steps is not None and args.finetune_steps < 1:
        parser.error(f"--finetune-steps must be at least 1, got {args.finetune_steps}")
    if args.quant_block_size is not None and "int8" not in (args.reduce_dtype, args.gather_dtype):
        parser.error("--quant-block-size sizes int8 blocks: add --reduce-dtype int8 or --gather-dtype int8")
    return args


def fewer_bytes(args: argparse.Namespace) -> dict[str, Any]:
    """The fine-tune's strategy options the fewer-bytes flags ask for: none by default (the exact run)."""
    names = ("reduce_dtype", "gather_dtype", "quant_block_size")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # slicing bytes needs no workers
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")  # Lightning 2.6 on torch 2.13; harmless
    start = time.perf_counter()
    recipe, runs = (QUICK, Path(args.runs) / "quick") if args.quick else (FULL, Path(args.runs))
    if args.finetune_steps is not None:
        recipe = replace(recipe, finetune_steps=args.finetune_steps)
    out = Path(args.finetune_dir) if args.finetune_dir else runs / "finetune"
    L.seed_everything(0, verbose=False)
    ckpt = runs / "pretrain" / "gpt.ckpt"
    if not ckpt.exists():
        pretrain(recipe, ckpt)
    else:
        report(f"using the pretrained checkpoint {ckpt} (delete it to pretrain again)")
    finetune(recipe, ckpt, out, **fewer_bytes(args))
    report(f"fine-tuned weights: {out / 'gpt.ckpt'}", f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
