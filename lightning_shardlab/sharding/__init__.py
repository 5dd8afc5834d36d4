"""The sharding engine: flat parameters, units, the sharded model and the sharded optimizer.

In the order a step meets them:

    flat_param.py       ``FlatParamLayout`` and ``FlatParam``: the tensors of one unit laid out flat, sharded
    always_runs.py      evidence, read from a forward's source, that it runs every block of a container
    policy.py           which modules become units, and buckets of small blocks
    materialize.py      meta-device modules built unit by unit
    same_layout.py      setup's check that every rank built the same model; what the policy declined
    unit.py             one unit's state machine: gather, free, reduce gradients
    hooks.py            the forward and backward hooks that drive the units
    gradients.py        flat gradients, grad shards, and what the optimizer sees
    reduce_sample.py    a packed reduction's error, sampled: an exact reduce-scatter beside it, once in a while
    packing_error.py    what packing loses, per unit: sums against the exact values, combined over ranks
    unused_params.py    the ranks' agreement on which parameters got gradients
    divergent_units.py  what a collective mismatch between units means, and the fix
    build.py            ``shard_model``: a module made into units of flat parameters, in place
    checkpointing.py    activation checkpointing: the chosen modules' forward recomputed in backward
    sharded_model.py    ``ShardedModel``: the units of one module, a step, the refresh after it
    lookup.py           ``sharded_model_of(trainer)``: how the callbacks find it
    placeholders.py     a stage-3 parameter at rest: its shape answers, its values only through shard_reads.py
    shard_reads.py      a whole gradient or weight read in a hook, served from the shards (DDP's values)
    shard_reductions.py such a read's reductions (norm, sum, max, ...): this rank's partial, one all-reduce
    read_window.py      when reads are served, the gradients' stand-ins, and a read some ranks made alone
    optimizer.py        the user's optimizer (its class's name kept) over the module's parameters, stepping the
                        master shards; the global gradient norm
    stand_ins.py        the engine's tensors in an optimizer's param groups for one update, state beside them
    owners.py           whole-tensor optimizers (Muon, Adafactor): each parameter's owner rank, its pieces
    whole_step.py       their step: gather whole parameters on the owners, update, return the pieces
    refused_optimizers.py  what no sharding makes exact (LBFGS, SparseAdam, ZeroRedundancyOptimizer), and why
    gathered.py         full weights between steps for the user (``gathered_params``)
    averages.py         the sharded exponential average of the master shards (EMA)
    offload_tier.py     what the engine asks of an offload tier (offload/ implements it)
"""
