"""Checkpoints: two formats, one loader, at any world size and stage.

``state_dict_type="sharded"`` (the default) writes, at the checkpoint's path, a torch file with the whole state
dict that ``MyModule.load_from_checkpoint`` reads ([Note: the model file] in checkpoint/model_file.py), and
beside it a directory of shards; every rank writes its own slices into both, so no rank ever holds more than its
shard ([Note: the sharded checkpoint format] in checkpoint/format.py). ``state_dict_type="full"`` writes one
plain Lightning checkpoint file: the unsharded state dict and optimizer state, gathered one flat parameter at a
time and written by rank 0 (checkpoint/full.py); it loads with ``MyModule.load_from_checkpoint`` without this
package. ``state_dict_type="dcp"`` reads and writes torch Distributed Checkpoint directories, the format FSDP2 and
Lightning's FSDP write, each rank its own chunks (checkpoint/dcp_save.py, dcp_load.py); their ``.metadata`` is a
pickle, so a DCP directory is read only with that option (docs/checkpoints.md).

Loading detects the format (a model file, a shard directory, or a full file) and works at any world size and any
stage: each rank takes the elements of its new shard. Both formats are written atomically (complete, or absent:
checkpoint/atomic.py), keep non-model state that differs between ranks for every rank
(checkpoint/rank_state.py), and agree on one verdict before anything is loaded, so a missing, truncated or
altered file raises the same error on every rank, naming it. ``shardlab consolidate`` turns a sharded checkpoint
into a full one in one process (checkpoint/consolidate.py); ``shardlab inspect`` describes either
(checkpoint/describe.py). The files, one concept each:

    save_load.py      what the strategies call: save / load / load the weights, by format
    full.py           full state dicts: gather, and slice back into shards
    format.py         the sharded format on disk: metadata, verification, reads of element ranges
    model_file.py     the sharded checkpoint's path: a torch file of the whole state dict, written in parallel
    sharded_save.py   the collective sharded save
    sharded_load.py   the sharded load: the files a rank needs, its slices, at any world size and stage
    shard_tensors.py  what one rank's shard file holds
    owned_state.py    whole-tensor optimizers' state: each owner's file, read by the new owners
    async_save.py     a save written in the background (``async_save=True``), completed at the next wait
    rank_state.py     per-rank side state
    residuals.py      int8 error-feedback residuals: each rank's own, in either format
    fabric_state.py   Fabric's ``state`` dicts in the same layout, and back in the user's keys
    atomic.py         atomic commit, fsync, sizes and checksums; one destination on every rank
    consolidate.py    a sharded checkpoint into a full one, in one process (``shardlab consolidate``)
    stream_save.py    torch's file format, written one tensor at a time, or with holes for others to fill
    export.py         safetensors in the Hugging Face layout (``shardlab export``)
    describe.py       what a checkpoint holds (``shardlab inspect``)
    dcp_save.py       ``state_dict_type="dcp"``: a torch Distributed Checkpoint, each rank writing its own chunks
    dcp_load.py       a DCP checkpoint into shards, weights and optimizer state by name, at any world size and stage
    dcp_read.py       reading element runs of a DCP directory through DCP's planner; opened only when asked
    dcp_boxes.py      a rank's run of a parameter's elements as the boxes (chunks) DCP addresses
    dcp_names.py      a DCP checkpoint's names matched to the module's, as the source wrote them
    dcp_describe.py   what a DCP directory holds (``shardlab inspect DIR --format dcp``)
    dcp_export.py     a shardlab checkpoint into a DCP directory, in one process (``shardlab export --format dcp``)
"""
