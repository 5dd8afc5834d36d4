"""One collective as every rank must issue it (``CollectiveCall``), and what watches them (``CollectiveObserver``).

Every collective of a ``Comm`` (comm/collectives.py) is announced to its observers before it is launched and
after it is waited for: the guard's fingerprints (the same sequence on every rank) and its watchdog (what is
in flight, and since when) are observers; the verified wire (comm/verify.py) puts a call in each header.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as every rank must issue it: the same sequence of these on every rank."""

    seq: int  # this rank's count of collectives issued on its Comm
    kind: str  # all_gather, reduce_scatter, all_reduce, broadcast, all_gather_object, ...
    label: str  # what it moves, e.g. the flat parameter "blocks.3[float32]"
    numel: int  # elements of the full (gathered / reduced) tensor; 0 for objects
    dtype: str
    scope: str = "world"  # the kind of group it runs in (comm/mesh.py); each group numbers its own calls
    side: str = ""  # "host": on the group's gloo twin (comm/host_side.py), which numbers its calls apart

    @property
    def fingerprint(self) -> tuple:
        return (self.seq, self.kind, self.label, self.numel, self.dtype)


class CollectiveObserver:
    """Sees every collective of a Comm: ``started`` before it is launched (it may raise to stop it),
    ``launched`` with the works it travels as (async collectives: their completion can be asked without
    waiting), ``finished`` once it has been waited for."""

    def started(self, call: CollectiveCall) -> None:
        pass

    def launched(self, call: CollectiveCall, works: list) -> None:
        pass

    def finished(self, call: CollectiveCall, seconds: float) -> None:
        pass
