"""``python -m lightning_shardlab.cli``: the ``shardlab`` command without its script (guarded, so that importing the
module, as the manual's API reference does when it inspects the package, runs nothing)."""

from lightning_shardlab.cli import main

if __name__ == "__main__":
    main()
