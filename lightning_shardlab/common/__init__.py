"""What the two front doors (trainer/ and fabric/) share: their options, a sharded run's setup, the precision recipe.

options.py      the options of both strategies, written once (the config fields): signature, docs, checked configs
distributed.py  ``ShardLabDistributed``: devices, ranks, backend and process groups, the sharded model
precision.py    ``PrecisionRecipe``: the precision table on Lightning's plugin interface, and ``convert_plugin``
grad_scaler.py  ``ShardedGradScaler``: fp16's torch GradScaler over the master shards, overflow agreed by the ranks
process_start.py  ranks started by spawn or fork: fork after CUDA, what does not pickle, refused first
"""
