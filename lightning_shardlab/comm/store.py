"""The rendezvous store of a run, one namespace per attempt: the root of every key this package's groups write.

Every process group keeps its handshakes in the rendezvous store: a gloo group its ranks' listening
addresses, an NCCL group its unique id, each group its barrier counters, the guard its side channels
(guard/side_channel.py). torch names the keys after the group only (``default_pg/0/...``, ``.../1/...``
for the next ``new_group``; the counter restarts at 0 in a new process). Two things outlive a process group
and keep the old keys:

- torchrun's agent store: with ``TORCHELASTIC_USE_AGENT_STORE`` every attempt of a job uses the TCPStore the
  agent hosts, and torch adds nothing of the attempt to the keys (``_create_c10d_store`` in
  torch/distributed/rendezvous.py). A restarted rank then reads the dead attempt's address of its peer and
  fails to connect (``Gloo connectFullMesh failed ... Connection refused``), or retries it until the
  process group's timeout;
- a multi-tenant TCPStore (``env://`` without torchrun: rank 0 hosts it), which stays up in its process
  when the process group is destroyed and opened again (a second ``fit`` after ``destroy_process_group``).

So the world's process group is opened on ``PrefixStore(namespace(), store)``: every key under it, the
world's own, those of every group opened after it (mesh.py, verify.py: ``new_group`` keys into the default
group's store) and the side channels' (``_get_default_store``), is new to this attempt and this opening.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch.distributed as dist

_OPENINGS = itertools.count()  # process groups opened by this process (every rank opens as many, in order)


def namespace(world_size: int, opening: int) -> str:
    """The key prefix for the ``opening``-th process group this process opens in a world of ``world_size``.

    torchrun's run id and restart count name the attempt (the same on every rank of it); the world size
    parts the rounds of an elastic job that regrew without a restart (the restart count does not move then);
    ``opening`` parts the process groups one process opens in turn.
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"shardlab/{run}/attempt_{attempt}/world_{world_size}/{opening}"  # PrefixStore adds the "/"


def open_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.PrefixStore:
    """Collective: the rendezvous store at ``address:port`` as torch's ``env://`` opens it (a client of
    torchrun's agent store, or rank 0 hosting it), under a namespace no earlier process group has used."""
    host = f"[{address}]" if ":" in address else address
    store, _, _ = next(dist.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(namespace(world_size, next(_OPENINGS)), store)
