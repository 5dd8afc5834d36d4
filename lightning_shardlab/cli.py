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

See ``configs/gpt_*.yaml`` for complete examples.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_shardlab  # noqa: F401  (registers "shardlab", "shardlab_stage_1", ... with Lightning)


def main(argv: list[str] | None = None) -> None:
    """Run LightningCLI on ``argv`` (default: the command line)."""
    LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


if __name__ == "__main__":
    main()
