"""Fine-tune a small GPT fully sharded (ZeRO stage 3) on 2 CPU ranks, and show what it costs.

    python -m lightning_shardlab.examples.finetune            # a few minutes on a 2-core machine
    python -m lightning_shardlab.examples.finetune --quick    # tiny sizes, seconds (the tests run this)

1. Pretrain (only if ``runs/pretrain/gpt.ckpt`` does not exist yet): a byte-level GPT learns the
   docstrings of the Python standard library, sharded at stage 2; saved as a plain, full checkpoint.
2. Fine-tune it on the Python documentation's help topics, fully sharded (stage 3): validation
   perplexity and generated samples before and after, the budget tables, ``runs/finetune/loss.png``, and
   the vital signs dashboard of every rank, ``runs/finetune/vitals/vitals.html``.

Lightning's launcher starts the second rank by running this same script again, so every rank executes
``main`` from the top: every rank builds the same models and calls every collective (validate, fit,
generate, save) in the same order. Only printing is left to rank 0.
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

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


def make_trainer(
    recipe: Recipe, stage: int, steps: int, data: TextDataModule, logs: Path, *callbacks: L.Callback
) -> L.Trainer:
    # unit_classes=[Block]: one unit per transformer block, so stage 3 gathers one block at a time (the budget's
    # "units:" line says so). The default would merge these small blocks into one bucket, a unit the size of
    # the model: right for speed at this size, but it would show nothing of per-unit gathering.
    return L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=ShardLabStrategy(stage=stage, state_dict_type="full", unit_classes=[Block]),
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


def finetune(recipe: Recipe, init_from: Path, out: Path) -> tuple[float, float]:
    report(f"\n=== 2. fine-tuning on python help topics, fully sharded (stage 3, 2 ranks), from {init_from} ===")
    model = GPT(
        **recipe.model, lr=recipe.finetune_lr, warmup_steps=recipe.finetune_steps // 10, init_from=str(init_from)
    )
    data = data_for(recipe, "python_topics")
    report(f"data: {data.fingerprint()}")
    vitals = ShardLabVitals(every_n_steps=5, dashboard_dir=str(out / "vitals"))  # every rank's signs, overlaid
    trainer = make_trainer(recipe, 3, recipe.finetune_steps, data, out, vitals)
    before = perplexity(trainer, model, data)
    show_samples("before fine-tuning", samples(model, recipe.new_tokens))
    trainer.fit(model, datamodule=data)
    after = perplexity(trainer, model, data)
    show_samples("after fine-tuning", samples(model, recipe.new_tokens))
    report(f"\nvalidation perplexity on python help topics: before {before:.2f} -> after {after:.2f}")
    save_full_checkpoint(trainer, out / "gpt.ckpt")
    if trainer.global_rank == 0:
        plot_losses(Path(trainer.logger.log_dir) / "metrics.csv", out / "loss.png")
        report(f"vital signs of every rank (dashboard): {vitals.paths.get('html', 'not written')}")
    return before, after


def plot_losses(metrics_csv: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report("no loss plot: matplotlib is not installed. HINT: pip install 'lightning-shardlab[plot]'")
        return
    rows = list(csv.DictReader(metrics_csv.read_text().splitlines()))  # one row per logging call
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
        if points:
            ax.plot(*zip(*points), style, label=key)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title="fine-tune, stage 3, 2 CPU ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    report(f"loss curve: {png}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (seconds; for tests)")
    parser.add_argument("--runs", default="runs", help="output folder (default: ./runs)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # slicing bytes needs no workers
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")  # Lightning 2.6 on torch 2.13; harmless
    start = time.perf_counter()
    recipe, runs = (QUICK, Path(args.runs) / "quick") if args.quick else (FULL, Path(args.runs))
    L.seed_everything(0, verbose=False)
    ckpt = runs / "pretrain" / "gpt.ckpt"
    if not ckpt.exists():
        pretrain(recipe, ckpt)
    else:
        report(f"using the pretrained checkpoint {ckpt} (delete it to pretrain again)")
    finetune(recipe, ckpt, runs / "finetune")
    report(f"fine-tuned weights: {runs / 'finetune' / 'gpt.ckpt'}", f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
