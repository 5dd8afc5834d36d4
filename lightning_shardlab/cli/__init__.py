"""The ``shardlab`` command: ``shardlab fit|validate|test|predict --config X.yaml`` is LightningCLI.

Any LightningModule and LightningDataModule can be named in the YAML by ``class_path``; importing
``lightning_shardlab`` (done here) registers the strategy names, so a config may say either

    trainer:
      strategy: shardlab            # or shardlab_stage_1, shardlab_stage_2, shardlab_stage_3

or, with options,

    trainer:
      strategy:
        class_path: lightning_shardlab.ShardLabStrategy
        init_args: {stage: 2}

See ``configs/gpt_*.yaml`` for complete examples. The other subcommands are tools (``plan.py`` here is
``shardlab plan``, its tables in ``plan_tables.py``; ``__main__.py`` runs the command as ``python -m
lightning_shardlab.cli``; the checkpoint tools' ``main`` live beside their code in checkpoint/):

    shardlab plan --params 70e9 --world-size 64 --stage 3      # the budget before the hardware
    shardlab consolidate SRC DST                               # a sharded checkpoint -> one plain Lightning file
    shardlab export SRC DST [--prefix model.] [--dtype bf16]   # -> safetensors, Hugging Face layout
    shardlab export SRC DST --format dcp                       # -> a torch Distributed Checkpoint directory
    shardlab inspect CKPT [--verify] [--json]                  # stage, world size, units, bytes per rank
    shardlab inspect DCP_DIR --format dcp                      # a torch Distributed Checkpoint (unpickles it)
"""

from __future__ import annotations

import importlib
import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_shardlab  # noqa: F401  (registers "shardlab", "shardlab_stage_1", ... with Lightning)

TOOLS = {  # subcommand -> (module whose main(argv) runs it, what it does)
    "plan": (
        "lightning_shardlab.cli.plan",
        "the budget before the hardware: bytes per rank, traffic and time per step",
    ),
    "consolidate": (
        "lightning_shardlab.checkpoint.consolidate",
        "a sharded checkpoint -> one plain Lightning checkpoint file (no process group)",
    ),
    "export": (
        "lightning_shardlab.checkpoint.export",
        "a checkpoint -> safetensors in the Hugging Face layout (from_pretrained loads it), streamed",
    ),
    "inspect": (
        "lightning_shardlab.checkpoint.describe",
        "describe a checkpoint: complete or not, world size, stage, units, bytes per rank",
    ),
}
LIGHTNING = {
    "fit": "train (LightningCLI: --config X.yaml, and any Trainer, model, data or strategy option)",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "predictions on the predict set",
}


def usage() -> str:
    """Every subcommand, Lightning's and the tools."""
    width = max(map(len, (*LIGHTNING, *TOOLS))) + 2
    lines = [
        f"usage: shardlab {{{','.join((*LIGHTNING, *TOOLS))}}} ...",
        "",
        "Fully sharded training for PyTorch Lightning, and the tools around it.",
        "",
        "training (LightningCLI):",
    ]
    lines += [f"  {name:{width}}{what}" for name, what in LIGHTNING.items()]
    lines += ["", "tools:"] + [f"  {name:{width}}{what}" for name, (_, what) in TOOLS.items()]
    lines += ["", "`shardlab <subcommand> --help` shows a subcommand's options, e.g. shardlab fit --help."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """A tool subcommand, or LightningCLI on ``argv`` (default: the command line)."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words and words[0] in TOOLS:
        importlib.import_module(TOOLS[words[0]][0]).main(words[1:])
        return
    if not words or words[0] in ("-h", "--help"):
        print(usage())
        return
    LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )
