"""Lightning's training loop broadcasts rank 0's SIGTERM flag before every batch with ``torch.distributed`` itself:
here it travels through the verified collectives (comm/collectives.py) instead.

A raw collective is invisible to the verification: a rank that issued one more collective than its peers (a gradient
or weight read on some ranks only, sharding/shard_reads.py) would wait in a verified exchange while the peers wait in
Lightning's raw broadcast, which never pair up, and the run would hang until the watchdog's timeout. Verified, the
broadcast meets the extra call at once, and every rank raises naming it. Same values, one small call as before.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm


def verify_sigterm_broadcast(trainer: Any, comm: Comm) -> None:
    """Route the epoch loop's SIGTERM broadcast through ``comm`` (when its collectives are verified)."""
    loop = trainer.fit_loop.epoch_loop
    comm = comm.host_side  # a host fact travels on the host (comm/host_side.py); on gloo, the group itself
    if comm.headers is None or comm.world_size == 1:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)  # Lightning's own, as before
        return

    def broadcast_sigterm_tensor() -> None:
        flag = torch.tensor([int(bool(getattr(trainer, "received_sigterm", False)))], device="cpu")
        collectives.broadcast(flag, comm, src=0, label="sigterm")
        if flag.item() == 1:
            collectives.barrier(comm, label="sigterm")  # every rank stops after the same batch, as Lightning's does
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = broadcast_sigterm_tensor
