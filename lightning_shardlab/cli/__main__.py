"""``python -m lightning_shardlab.cli``: the ``shardlab`` command without its script."""

from lightning_shardlab.cli import main

main()
