"""The sanity guard: catches the distributed bugs that are otherwise silent (docs/sanity.md).

One rank crashing, ranks hanging on a collective, ranks issuing different collectives, replicas quietly
diverging, ranks reading the same data. ``SanityGuard`` (sanity_guard.py) wires the pieces together for one
sharded model; ``ShardLabSanity`` (callback.py) drives it from the Trainer, and the strategy adds one by
default. The guard never imports the strategy. Each piece lives in its own file:

    fingerprints.py  collective fingerprints: the cheap check every K steps, the strict check per call
    divergence.py    replicated state compared by digest every K steps; the batch's digest
    data_source.py   where each rank's batches come from: its DataLoader's sampler, read without drawing from it
    duplicate_data.py  the data check's verdict: the same samples stop the run, equal batches it cannot judge warn
    device_check.py  both in one all-gather per check, read without a wait (a GPU's verdict: the next step)
    watchdog.py      hangs, failed and killed ranks: ends the run on every rank with a report (report.py)
    device_queue.py  the collectives a GPU has not finished, asked without waiting: a hang the host does not see
    side_channel.py  the rendezvous store as a channel that works while the process group is stuck
    orderly_stop.py  SIGTERM on any rank stops every rank after the same step
    stop_checkpoint.py  ``CheckpointOnStop``: a complete checkpoint on that stop (not on a crash)
    sanity_guard.py  ``SanityConfig`` and ``SanityGuard``
    callback.py      ``ShardLabSanity``

A plain loop::

    guard = SanityGuard(sharded, [optimizer], SanityConfig(every_n_steps=10))
    with guard:                              # watchdog and observers on; a clean exit runs a last check
        for step, batch in enumerate(loader):
            guard.before_step(step, batch, loader)  # every K steps: fingerprints, replicated state, data
            ...                              # forward, backward, optimizer.step()
            if guard.stop_after(step):       # SIGTERM on any rank: True on every rank after the same step
                break
"""
