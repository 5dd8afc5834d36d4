"""What it means for ranks to disagree on a collective, and how that is told. Nothing here communicates.

Every collective has a fingerprint, ``(seq, kind, label, numel, dtype)`` (``CollectiveCall``, comm/call.py):
its sequence number on this rank, what it is (all_gather, reduce_scatter, ...), what it moves (a flat
parameter is labelled by its unit and dtype, e.g. ``blocks.3[float32]``), and its size. Ranks agree when
they issue the same fingerprints in the same order. Three checks compare them (comm/verify.py before every
call, guard/fingerprints.py every K steps and, in strict mode, through the store); all three raise
``CollectiveMismatch`` with the message below, on every rank at once, since every rank compares the same
gathered fingerprints.
"""

from __future__ import annotations

Fingerprint = tuple  # (seq, kind, label, numel, dtype): CollectiveCall.fingerprint

GENERIC_HINT = (
    "look for code that runs a unit (or a collective) on some ranks only: a data-dependent branch, an early exit,"
    " or code under `if trainer.is_global_zero`"
)


class SanityError(RuntimeError):
    """A fault a sanity check found. Raised on every rank at the same point (each rank sees the same
    gathered data), so no rank is left waiting and the watchdog need not stop the others."""


class CollectiveMismatch(SanityError):
    """The ranks issued different collectives."""


class CollectiveTimeout(RuntimeError):
    """A collective did not start on every rank in time (raised by the strict check)."""


def describe(fp: Fingerprint | None) -> str:
    """``#57 all_gather 'blocks.2[float32]' numel=120 float32``, or 'nothing' for a missing call."""
    if fp is None:
        return "nothing"
    seq, kind, label, numel, dtype = fp
    return f"#{seq} {kind}" + (f" {label!r}" if label else "") + (f" numel={numel} {dtype}" if numel else "")


def first_difference(calls: dict[int, dict[int, Fingerprint]]) -> tuple[int, dict[int, Fingerprint | None]] | None:
    """``calls``: rank -> {seq: fingerprint}. The lowest seq whose fingerprint differs, with every rank's."""
    seqs = sorted({seq for per_rank in calls.values() for seq in per_rank})
    for seq in seqs:
        each = {rank: per_rank.get(seq) for rank, per_rank in calls.items()}
        if len(set(each.values())) > 1:
            return seq, each
    return None


def by_call(each: dict[int, Fingerprint | None]) -> list[tuple[Fingerprint | None, list[int]]]:
    """The distinct fingerprints with the ranks that issued each, the one most ranks issued first."""
    groups: dict[Fingerprint | None, list[int]] = {}
    for r, fp in sorted(each.items()):
        groups.setdefault(fp, []).append(r)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), min(item[1])))


def mismatch_message(
    rank: int, seq: int, each: dict[int, Fingerprint | None], when: str, hint: str = GENERIC_HINT
) -> str:
    """Name every rank's fingerprint (most ranks' first) and the fix."""
    issued = "; ".join(f"rank {', '.join(map(str, ranks))} issued {describe(fp)}" for fp, ranks in by_call(each))
    return (
        f"[rank {rank}] collective #{seq} differs across ranks ({when}): {issued}. The ranks no longer run the same"
        f" collectives in the same order. HINT: {hint}."
    )
