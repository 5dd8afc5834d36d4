"""Communication: every collective the project issues, counted and verified (the layer everything else uses).

    collectives.py      ``Comm`` (a process group with its ledger and observers) and the collectives, sync or async
    packed_collectives.py  the all-gather and reduce-scatter in fewer bytes (packed on the wire, summed in fp32)
    call.py             ``CollectiveCall`` (one collective as every rank must issue it) and its observers
    packing.py          packed payloads: bf16 / fp16, int8 in blocks with one scale each (fewer bytes)
    mesh.py             the groups of hybrid sharding: world, shard group, replica group, reshard group
    host_side.py        each NCCL group's gloo twin: host facts and objects travel without touching the device
    host_reads.py       the one seam where the host reads a device value (a wait for its queue), counted
    transport.py        launching on torch.distributed: one ``Launched`` per call, waited once
    transport_probe.py  which transport each collective takes on gloo, timed once at setup
    link_probe.py       a link timed with batches of all-gathers: a run's groups, or two gloo ranks of its own (plan)
    store.py            the rendezvous store under a namespace of this attempt: what a torchrun restart left is not read
    wire.py             self-verifying collectives as pairwise sends: a header before each payload
    verify.py           the header codec, and the header exchange for backends where pairs do not fit
    mismatch.py         the errors, and the message naming where two ranks parted
    labels.py           profiler labels for the phases of a step
    ledger.py           bytes, counts and blocked seconds per collective kind, label and group kind
    step_clock.py       where this rank's time goes: the step's phase, the unit computing, a collective blocking

Nothing here knows about parameters or units: callers pass tensors and a label (the step clock, a unit's name).
"""
