"""A job that survives restarts: torchrun restarts it after a rank dies, a scheduler requeues it after SIGTERM, and
every time it resumes from its last complete checkpoint by itself.

    torchrun --standalone --nproc_per_node 2 --max-restarts 3 -m lightning_shardlab.examples.resumable --out runs/r

The recipe is three pieces of Lightning: a ``ModelCheckpoint`` that writes ``last.ckpt`` at every epoch's end,
``CheckpointOnStop`` (Lightning's ``OnExceptionCheckpoint``, for an orderly stop only) so that SIGTERM (the
strategy's ``handle_sigterm``, on by default: every rank stops after the same step) writes a complete ``last.ckpt``
first, and ``trainer.fit(..., ckpt_path="last")``, which resumes from it when there is one. A crash writes nothing:
its survivors cannot save a sharded checkpoint without the rank that died, and a checkpoint taken mid-epoch resumes
Lightning's loop less exactly than one taken at an epoch's end. A checkpoint is complete once its ``COMPLETE``
marker is written and its model file is moved into place (checkpoint/model_file.py), so a rank that dies while
one is written, in the background too (``async_save``), leaves the previous one in place.

To show it, and for the tests and ``benchmarks/restarts.py``, the job can hurt itself: ``--die-at-step N`` ends it
once optimizer step N of its first attempt is done (``--die-how exit``: rank 1 leaves at once, as a crashed rank
does; ``sigterm``: every rank is sent SIGTERM, as a preempted job is; ``raise``: every rank raises ``Stopped``).
``--chain`` runs several strategies one after another in the same processes (``trainer.fit`` again, new groups each
time), each hurt the first time it runs (``--die-at-step``, ``--die-how`` and ``--async-save`` take one value, or
one per entry: ``--chain shardlab_stage_2,ddp --die-at-step 5,6``): each restart resumes one of them and hurts the
next. Each strategy's final weights go to ``OUT/<name>/final.pt`` and what each attempt did (the step it resumed
from, a save in flight when it died) to ``OUT/<name>/attempts.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardlab.guard.stop_checkpoint import CheckpointOnStop

WIDTH, DEPTH, BATCH = 16, 3, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x))


class Regressor(L.LightningModule):
    """A small residual MLP, one unit per block, trained with AdamW (state that a resume must restore)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(world_size: int, steps_per_epoch: int) -> DataLoader:
    """The same samples on every attempt; Lightning's distributed sampler shuffles them by epoch."""
    g = torch.Generator().manual_seed(0)
    n = world_size * BATCH * steps_per_epoch
    x = torch.randn(n, WIDTH, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=BATCH, shuffle=True)


class Hurt(L.Callback):
    """Once optimizer step ``at`` is done, as the next batch begins (before the strategy's own hooks, which may
    complete a checkpoint in flight): ``exit`` (rank 1 leaves) or ``sigterm`` (every rank is sent SIGTERM). Writes
    what it did first, with whether a background save was in flight."""

    def __init__(self, at: int, how: str, diary: Path) -> None:
        self.at, self.how, self.diary = at, how, diary

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at:
            return
        saver = getattr(trainer.strategy, "_saver", None)
        note(self.diary, trainer, event=f"hurt ({self.how})", save_in_flight=bool(saver is not None and saver.pending))
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.how == "raise":
            raise Stopped(f"stopped once step {self.at} was done")
        elif trainer.global_rank == 1:
            os._exit(1)


class Stopped(RuntimeError):
    """``--die-how raise``: every rank raises at the same point, as a bug in the training code would."""


class Diary(L.Callback):
    """Notes the step each fit starts from (0, or the checkpoint it resumed)."""

    def __init__(self, diary: Path) -> None:
        self.diary = diary

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        note(self.diary, trainer, event="start")


def note(diary: Path, trainer: L.Trainer, **fields: Any) -> None:
    if trainer.global_rank == 0:
        entry = {"attempt": attempt(), "step": trainer.global_step, "time": time.time(), **fields}
        with diary.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def hurt_before(diary: Path) -> bool:
    """Whether this run was hurt already (each run is hurt once: the restart that resumes it is not)."""
    return diary.exists() and '"event": "hurt' in diary.read_text()


def attempt() -> int:
    """This attempt's number: torchrun's restarts, plus the launches before this one (``--launch``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get("RESUMABLE_LAUNCH", "0"))


def make_strategy(spec: str, async_save: bool, shard_group_size: int | None) -> Any:
    """A registered name (``ddp``, ``shardlab_stage_2``, ...), ``shardlab`` with options, or ``module:factory``;
    ``@k`` after it names a further run of the same (``shardlab_stage_2@3``: its own directory)."""
    spec = spec.split("@")[0]
    if ":" in spec:
        module, name = spec.split(":")
        return getattr(importlib.import_module(module), name)()
    if not spec.startswith("shardlab"):
        return spec
    from lightning_shardlab import ShardLabStrategy

    stage = int(spec.removeprefix("shardlab_stage_")) if spec.startswith("shardlab_stage_") else 3
    return ShardLabStrategy(stage=stage, unit_classes=[Block], async_save=async_save, shard_group_size=shard_group_size)


def fit_one(spec: str, args: argparse.Namespace) -> None:
    """Fit ``spec`` to the end, resuming from its ``last.ckpt``; hurt the first time it runs (``--die-at-step``)."""
    out = Path(args.out) / spec.replace(":", "-")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "final.pt").exists():
        return
    diary, checkpoints = out / "attempts.jsonl", out / "checkpoints"
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_last=True),
        CheckpointOnStop(dirpath=checkpoints, filename="last"),
        Diary(diary),
    ]
    if args.die_at_step and not hurt_before(diary):
        callbacks.append(Hurt(args.die_at_step, args.die_how, diary))
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=1, max_epochs=args.epochs, callbacks=callbacks,
        strategy=make_strategy(spec, args.async_save, args.shard_group_size), default_root_dir=out,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Regressor()
    trainer.fit(model, data(trainer.world_size, args.steps_per_epoch), ckpt_path="last")  # if there is one
    full = getattr(trainer.strategy, "full_state_dict", None)
    state = full() if full is not None else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / "final.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the job's directory: checkpoints, final weights, its diary")
    parser.add_argument("--chain", default="shardlab", help="strategies fitted one after another, comma-separated")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument(
        "--die-at-step", default="0", help="end the first attempt after this step (or one per --chain entry: 5,6)"
    )
    parser.add_argument("--die-how", default="exit", help="exit, sigterm or raise (or one per --chain entry)")
    parser.add_argument(
        "--async-save", nargs="?", const="1", default="0", help="shardlab's async_save=True (or 0/1 per --chain entry)"
    )
    parser.add_argument("--shard-group-size", type=int, default=None, help="hybrid sharding: ranks per shard group")
    args = parser.parse_args(argv)
    chain = args.chain.split(",")
    steps, hows, saves = (
        per_entry(text, len(chain), option)
        for text, option in ((args.die_at_step, "--die-at-step"), (args.die_how, "--die-how"),
                             (args.async_save, "--async-save"))
    )  # fmt: skip
    if any(how not in ("exit", "sigterm", "raise") for how in hows) or any(a not in ("0", "1") for a in saves):
        parser.error(f"--die-how: each of exit, sigterm, raise ({args.die_how!r}); --async-save: 0 or 1")
    torch.set_num_threads(1)
    for spec, step, how, save in zip(chain, steps, hows, saves):
        entry = {"die_at_step": int(step), "die_how": how, "async_save": save == "1"}
        fit_one(spec, argparse.Namespace(**{**vars(args), **entry}))


def per_entry(text: str, entries: int, option: str) -> list[str]:
    """``option``'s value for each of the chain's ``entries``: one for all, or one each."""
    values = text.split(",")
    if len(values) not in (1, entries):
        raise SystemExit(f"{option}: one value, or one per --chain entry ({entries}), not {text!r}")
    return values * entries if len(values) == 1 else values


if __name__ == "__main__":
    main()
