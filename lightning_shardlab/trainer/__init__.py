"""The Trainer's front door: ``Trainer(strategy="shardlab")`` and what it brings with it.

strategy.py             ``ShardLabStrategy``: the Lightning strategy (hooks, checkpoints, the registered names)
precision.py            ``ShardLabPrecision``: the Trainer's precision plugin on the shared recipe
ema.py                  ``ShardLabEMA``: an average of the weights, kept sharded like the masters
swa.py                  ``ShardLabSWA``: Lightning's StochasticWeightAveraging with its average sharded
lightning_callbacks.py  Lightning's ``ModelPruning`` and ``BaseFinetuning`` on sharded parameters
"""
