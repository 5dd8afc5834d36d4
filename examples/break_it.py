"""BREAK IT: three ways distributed training goes wrong without crashing, and what catches each.

    python examples/break_it.py             # all three, one after another on 2 ranks (about 20 s on 2 cores)
    python examples/break_it.py diverge     # one of: diverge, skip, same-data

1. diverge    Silent divergence. A frozen position embedding is re-initialised after a per-rank seed was
              set (a common slip: seeding augmentation by rank, then building a layer lazily). Every
              rank's loss curve looks fine; each rank trains a different model. The replicated-state
              check (every ``every_n_steps``) names the rank, the parameter and the first element.
2. skip       One rank skips a collective. A data-dependent shortcut skips the last block for "easy"
              batches, and the blocks were named as units (``unit_classes``; the default policy would
              not make units of blocks run under a condition), so a rank whose batch is easy issues one
              all-gather fewer: unchecked, the ranks would pair up the wrong collectives (wrong weights,
              then gloo's abort or a hang). Verified collectives (on by default) compare every call's
              fingerprint first: the run stops on both ranks at that collective, naming the unit each
              rank gathered and the fix, before any data moves.
3. same-data  Every rank reads the same data. A DataLoader without a DistributedSampler (here with
              Lightning's sampler injection turned off) hands each rank the same batches: N ranks, the
              cost of N, the progress of one. The data check names the ranks with identical batches.

Lightning's launcher starts rank 1 by running this script again with the same arguments, so each fault
runs on both ranks; both raise the same error (the checks raise on every rank), print it, and go on together
to the next fault.
"""

from __future__ import annotations

import os
import sys
import time

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.comm.mismatch import CollectiveMismatch
from lightning_shardlab.examples.gpt import GPT
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.divergence import DivergenceError, DuplicateDataError

FAULTS = {"diverge": DivergenceError, "skip": CollectiveMismatch, "same-data": DuplicateDataError}
SIZES = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, warmup_steps=2)


class DivergingGPT(GPT):
    """The position embedding is frozen, then re-initialised under a per-rank seed: the bug."""

    def __init__(self) -> None:
        super().__init__(**SIZES)
        self.wpe.weight.requires_grad_(False)

    def on_train_start(self) -> None:
        torch.manual_seed(1234 + self.global_rank)  # per-rank seed, meant for data augmentation ...
        with torch.no_grad():
            self.wpe.weight.normal_(std=0.02)  # ... and a lazy re-initialisation that picks it up: the bug


class ShortcutGPT(GPT):
    """Skips the last block when its batch looks easy (decided from this rank's own data): the bug."""

    def __init__(self) -> None:
        super().__init__(**SIZES)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (b, t, c)
        easy = bool(idx[0, 0] % 2 == 0)
        for block in self.blocks[:-1] if easy else self.blocks:
            x = block(x)  # (b, t, c)
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)


def tokens(n: int, seed: int = 0) -> TensorDataset:
    data = torch.randint(
        0, SIZES["vocab_size"], (n, SIZES["block_size"] + 1), generator=torch.Generator().manual_seed(seed)
    )
    return TensorDataset(data[:, :-1], data[:, 1:])


def run_fault(fault: str) -> bool:
    """One 2-rank run with the fault; prints what caught it (on every rank) and returns whether it was caught.
    A caught fault is raised on every rank at the same point, so the ranks go on together to the next run."""
    torch.manual_seed(0)
    model = {"diverge": DivergingGPT, "skip": ShortcutGPT, "same-data": lambda: GPT(**SIZES)}[fault]()
    sanity = ShardLabSanity(every_n_steps=5, collective_timeout_s=60)
    units = ["lightning_shardlab.examples.gpt.Block"] if fault == "skip" else None  # the user shards every block
    strategy = ShardLabStrategy(stage=2 if fault == "diverge" else 3, unit_classes=units)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=12,
        callbacks=[sanity],
        use_distributed_sampler=fault != "same-data",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    try:
        trainer.fit(model, DataLoader(tokens(96), batch_size=4, shuffle=False))
    except FAULTS[fault] as error:
        print(f"[rank {trainer.global_rank}] {fault}: caught {type(error).__name__}:\n{error}\n", flush=True)
        return True
    print(f"[rank {trainer.global_rank}] {fault}: NOT caught (training finished)", flush=True)
    return False


def run_all() -> int:
    """The three faults one after another on the same 2 ranks (Lightning's launcher starts rank 1 at the first
    fit); a summary at the end."""
    caught = {}
    for fault in FAULTS:
        started = time.monotonic()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"==== {fault} " + "=" * 60, flush=True)
        caught[fault] = run_fault(fault)
        print(f"[rank {os.environ.get('LOCAL_RANK', 0)}] ({time.monotonic() - started:.0f} s)\n", flush=True)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print("summary: " + ", ".join(f"{f}: {'caught' if ok else 'NOT CAUGHT'}" for f, ok in caught.items()))
    return 0 if all(caught.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        if sys.argv[1] not in FAULTS:
            sys.exit(f"unknown fault {sys.argv[1]!r}: choose one of {', '.join(FAULTS)} (or nothing for all three)")
        run_fault(sys.argv[1])
    else:
        sys.exit(run_all())
