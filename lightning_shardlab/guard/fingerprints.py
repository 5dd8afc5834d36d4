"""Collective fingerprints: every rank must issue the same collectives in the same order.

Each collective announces itself to ``comm.observers`` as a ``CollectiveCall`` whose fingerprint is
(sequence number, kind, label, numel, dtype); the label names the unit and dtype of a parameter
collective, e.g. ``blocks.3[float32]`` (comm/mismatch.py). comm/verify.py checks every call before it runs; two
more checks compare fingerprints across ranks:

    cheap   ``FingerprintRecorder`` folds every fingerprint into a running digest and keeps the
            recent ones; every K steps ``check_fingerprints`` all-gathers one (count, digest) pair per
            rank: one 16-byte-per-rank collective. A difference is found within K steps, after the fact,
            and named exactly by a second exchange (of the recent fingerprints) that runs only then.
    strict  ``StrictCollectives`` exchanges each call's fingerprint through the rendezvous store before
            the collective is launched (guard/side_channel.py): a mismatch raises on every rank before any
            wrong data moves. A few store round trips per collective: a debug mode.

A rank that skips a collective shifts its sequence numbers, so its next call carries the skipped one's
number with another label: both checks catch that as a mismatch at that number.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque

import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.call import CollectiveCall, CollectiveObserver
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.comm.mismatch import (
    GENERIC_HINT,
    CollectiveMismatch,
    CollectiveTimeout,
    Fingerprint,
    describe,
    first_difference,
    mismatch_message,
)
from lightning_shardlab.guard.side_channel import SideChannel

CHEAP_HINT = f"{GENERIC_HINT}; strict_collectives=True stops at the first differing call"


class FingerprintRecorder(CollectiveObserver):
    """The cheap check's memory: a digest of every fingerprint since the last check, and the recent ones."""

    def __init__(self, keep: int = 4096) -> None:
        self.recent: deque[Fingerprint] = deque(maxlen=keep)  # what the mismatch message names
        self._digest = hashlib.blake2b(digest_size=8)
        self.count = 0

    def started(self, call: CollectiveCall) -> None:
        self._digest.update(repr(call.fingerprint).encode())
        self.recent.append(call.fingerprint)
        self.count += 1

    def summary(self) -> torch.Tensor:
        """(count, digest) as int64: 1-D, numel 2."""
        digest = int.from_bytes(self._digest.digest(), "little", signed=True)
        return torch.tensor([self.count, digest], dtype=torch.int64)

    def clear(self) -> None:
        self.recent.clear()
        self._digest = hashlib.blake2b(digest_size=8)
        self.count = 0


def check_fingerprints(comm: Comm, recorder: FingerprintRecorder, when: str = "") -> None:
    """Collective: raise ``CollectiveMismatch`` on every rank unless all ranks issued the same collectives
    since the last check. One all-gather of 2 int64 per rank; a second exchange only on a mismatch."""
    if comm.world_size == 1:
        return
    mine = recorder.summary()  # a host fact: it travels on the host side (comm/host_side.py)
    everyone = torch.empty(comm.world_size * 2, dtype=torch.int64)  # 1-D, world * 2
    collectives.all_gather(everyone, mine, comm.host_side, label="sanity fingerprints", kind="sanity")
    if bool((everyone.view(-1, 2) == mine).all()):
        recorder.clear()
        return
    recents = collectives.all_gather_object(list(recorder.recent), comm, label="sanity fingerprints")
    found = first_difference({r: {fp[0]: fp for fp in recent} for r, recent in enumerate(recents)})
    when = when or "cheap check"
    if found is None:  # the difference is older than what the recorders keep
        raise CollectiveMismatch(
            f"[rank {comm.rank}] the ranks issued different collectives since the last check ({when}), before"
            f" the {recorder.recent.maxlen} most recent ones. HINT: check more often (every_n_steps) or use"
            " strict_collectives=True to stop at the first differing call."
        )
    raise CollectiveMismatch(mismatch_message(comm.rank, *found, when=when, hint=CHEAP_HINT))


class StrictCollectives(CollectiveObserver):
    """Before each collective: post its fingerprint to the store, read every rank's, raise on a difference.

    Keys ``<seq>/<rank>``. A rank at call k has read every rank's key k-1, and they had read its key
    k-2 before posting theirs, so it deletes its own key k-2: the store holds at most two calls per rank.
    """

    def __init__(self, channel: SideChannel, comm: Comm, timeout_s: float = 300.0) -> None:
        self.channel, self.comm, self.timeout_s = channel, comm, timeout_s
        self.store = channel.store

    @staticmethod
    def open(comm: Comm, timeout_s: float = 300.0) -> StrictCollectives | None:
        channel = SideChannel.open("strict", comm.rank, comm.world_size)
        return None if channel is None else StrictCollectives(channel, comm, timeout_s)

    def started(self, call: CollectiveCall) -> None:
        rank, world = self.channel.rank, self.channel.world_size
        self.channel.put(f"{call.seq}/{rank}", list(call.fingerprint))
        if call.seq >= 2:
            self.store.delete_key(f"{call.seq - 2}/{rank}")
        keys = [f"{call.seq}/{r}" for r in range(world)]
        with self.comm.blocking():
            self._wait(keys, call)
        each = {r: tuple(json.loads(v)) for r, v in enumerate(self.store.multi_get(keys))}
        if len(set(each.values())) > 1:
            raise CollectiveMismatch(mismatch_message(rank, call.seq, each, when="strict check, before it ran"))

    def _wait(self, keys: list[str], call: CollectiveCall) -> None:
        """Poll (``check`` never blocks, so a pending stop signal is served) until every rank has posted."""
        start, pause = time.monotonic(), 0.0002
        while not self.store.check(keys):
            if time.monotonic() - start > self.timeout_s:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise CollectiveTimeout(
                    f"[rank {self.channel.rank}] rank {', '.join(map(str, missing))} did not reach collective"
                    f" {describe(call.fingerprint)} within {self.timeout_s:.0f} s (strict check). HINT: that rank"
                    " is stuck or skipped a collective; the watchdog's report (collective_timeout_s) says where it is."
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
