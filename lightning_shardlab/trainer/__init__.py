"""The Trainer's front door: ``Trainer(strategy="shardlab")`` and what it brings with it.

strategy.py             ``ShardLabStrategy``: the Lightning strategy (hooks, checkpoints, the registered names)
precision.py            ``ShardLabPrecision``: the Trainer's precision plugin on the shared recipe
ema.py                  ``ShardLabEMA``: an average of the weights, kept sharded like the masters
swa.py                  ``ShardLabSWA``: Lightning's StochasticWeightAveraging with its average sharded
weight_averaging.py     ``ShardLabWeightAveraging``: Lightning's WeightAveraging with its average sharded
averaging_subclasses.py users' subclasses of both run over that machinery, their overrides kept
average_readers.py      a subclass that reads the whole averaged module: found, and refused naming its method
lightning_callbacks.py  Lightning's ``ModelPruning`` and ``BaseFinetuning`` on sharded parameters
compiled.py             ``trainer.fit(torch.compile(model))``: Lightning's check admits the strategy
checkpoint_io.py        a user's ``CheckpointIO`` plugin writes the checkpoints (one file each), as under DDP
loop_collectives.py     Lightning's per-batch SIGTERM broadcast through the verified collectives
spawn_launcher.py       ``start_method`` spawn/fork (``shardlab_spawn``, ``shardlab_notebook``): ranks started here
spawn_results.py        what such ranks send back: whole weights, the callbacks' best path, score and state
"""
