"""The side channel: the rendezvous store, used to talk between ranks without the collective backend.

When a collective hangs, the backend is the one thing that cannot be asked what is going on. Every rank
already holds a client of the key-value store its process group was built with (the TCPStore that rank 0
hosts under ``env://``, or torchrun's agent store), and that store keeps answering while gloo or NCCL
wait. The sanity checks (fingerprints.py), the watchdog (watchdog.py) and the orderly stop (orderly_stop.py)
each talk through a ``SideChannel``: their own namespace of that store and their own connection to it.

Namespaces: ``shardlab/<purpose>/<session>/``. The session is this rank's count of channels opened for
that purpose, so a second ``Trainer.fit`` in the same process group never reads the first one's keys
(every rank opens the same channels in the same order, so the counts agree). The counts start again in a
restarted process, but so does the store's namespace: the process group is opened on a namespace of its
own torchrun attempt and opening (comm/store.py), and the default store carries it, so a restart never
meets the dead attempt's sessions, however many channels each of its ranks had opened.

Connections: ``Store.clone()`` opens a new connection to the same store; a client must not be shared by
two threads (a blocking ``wait`` on one would stall the other), so the watchdog thread gets its own. A channel
that closes gives its connections back, and the next channels on the same store (the next ``fit``'s) take them
again instead of connecting anew: every fit opens three or four per rank, and a connection to torch's TCPStore
can take seconds to open (under some sandboxed network stacks one connect in ten or so waited 5 s, and every
rank waited with it).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def default_store() -> dist.Store | None:
    """The store the default process group was built with, or None when there is no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def this_process() -> dict[str, Any]:
    """Where this rank runs: enough for another rank on the same host to tell whether it still exists."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def process_gone(where: dict[str, Any]) -> bool:
    """True if ``where`` (from ``this_process`` on another rank) names a process on this host that has ended.

    A killed child stays a zombie until its parent reaps it, so a zombie counts as gone. Ranks on other
    hosts cannot be checked this way (False): their heartbeats tell instead.
    """
    if where.get("host") != socket.gethostname():
        return False
    pid = int(where["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class _Connections:
    """This process's idle connections to the default store: the current one's only (a new process group
    brings a new store, and the old one's connections go with it)."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.idle: list[dist.Store] = []

    def take(self, store: dist.Store, timeout_s: float) -> dist.Store:
        if self.store is not store:
            self.store, self.idle = store, []
        client = self.idle.pop() if self.idle else store.clone()
        client.set_timeout(timedelta(seconds=timeout_s))
        return client

    def give_back(self, store: dist.Store, clients: list[dist.Store]) -> None:
        if self.store is store:
            self.idle.extend(clients)


_CONNECTIONS = _Connections()


class SideChannel:
    """One purpose's namespace of the rendezvous store, on a connection of its own."""

    def __init__(self, purpose: str, rank: int, world_size: int, store: dist.Store, timeout_s: float = 30.0) -> None:
        self.purpose, self.rank, self.world_size, self.timeout_s = purpose, rank, world_size, timeout_s
        self._origin = store
        self._base = _CONNECTIONS.take(store, timeout_s)
        self._clients = [self._base]
        session = self._base.add(f"shardlab/{purpose}/session/{rank}", 1)
        self.prefix = f"shardlab/{purpose}/{session}"  # PrefixStore adds the "/"
        self.store = dist.PrefixStore(self.prefix, self._base)

    @staticmethod
    def open(purpose: str, rank: int, world_size: int, timeout_s: float = 30.0) -> SideChannel | None:
        """The channel on the default process group's store; None at world size 1 or without a store."""
        store = default_store()
        if world_size == 1 or store is None:
            return None
        return SideChannel(purpose, rank, world_size, store, timeout_s)

    def connection(self) -> dist.PrefixStore:
        """Another connection to the same namespace (one per thread)."""
        client = _CONNECTIONS.take(self._origin, self.timeout_s)
        self._clients.append(client)
        return dist.PrefixStore(self.prefix, client)

    def close(self, reuse: bool = True) -> None:
        """Let go of this channel's connections once its checks are over, for later channels to use again
        (``reuse=False`` when a thread may still be using one: they close when their last client object goes)."""
        if reuse:
            _CONNECTIONS.give_back(self._origin, self._clients)
        self._clients = []
        self.store = self._base = None  # type: ignore[assignment]

    # ---- JSON values on this channel's own connection ----

    def put(self, key: str, value: Any) -> None:
        put(self.store, key, value)

    def read(self, key: str) -> Any | None:
        return read(self.store, key)

    def first(self, key: str, value: Any) -> Any:
        return first(self.store, key, value)


def put(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value, default=repr))


def read(store: dist.Store, key: str) -> Any | None:
    """The value under ``key``, or None if nobody has written it (never blocks)."""
    return json.loads(store.get(key)) if store.check([key]) else None


def first(store: dist.Store, key: str, value: Any) -> Any:
    """Write ``value`` under ``key`` unless someone already did; return whichever is there (atomic)."""
    return json.loads(store.compare_set(key, "", json.dumps(value, default=repr)))
