"""The watchdog's reports: the cause, what every rank was doing, and which rank is missing.

A rank's state is the heartbeat it last published (guard/watchdog.py): ``state`` (running, failed, stopped),
``issued`` (collectives it has announced), ``blocked`` (its main thread waits in a collective) and
``waiting_s`` (for how long, with no progress), ``inflight`` (its oldest collective launched and not yet
waited for), ``last`` (the last one finished) and ``idle_s`` (since then), ``where`` (its main thread's
innermost frame in user code), ``host`` and ``pid``.
"""

from __future__ import annotations

import traceback
from typing import Any

from lightning_shardlab.comm.mismatch import describe

HEADER = "shardlab watchdog: ending the run on every rank."

States = dict[int, dict[str, Any] | None]


def error_line(exc: BaseException) -> str:
    """``ValueError: message (at path:line in function)``: the first line, and where it was raised."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return text[:400] + where


def _fp(values: list | None) -> tuple | None:
    return None if values is None else tuple(values)


def state_line(rank: int, s: dict[str, Any] | None) -> str:
    if s is None:
        return f"rank {rank}: no heartbeat (it never started its watchdog, or ended before)"
    at = f" at {s['where']}" if s.get("where") else ""
    if s["state"] == "failed":
        return f"rank {rank}: failed with {s.get('error', 'an error')}"
    if s["state"] == "stopped":
        return f"rank {rank}: finished its run (stopped watching)"
    if s["blocked"]:
        return f"rank {rank}: waiting {s['waiting_s']:.1f} s in collective {_waited(s)}{at}"
    launched = f"; launched, not yet waited for: {describe(_fp(s['inflight']))}" if s["inflight"] else ""
    return (
        f"rank {rank}: running outside any collective for {s['idle_s']:.1f} s (last finished:"
        f" {describe(_fp(s['last']))}{launched}){at}"
    )


def _waited(s: dict[str, Any]) -> str:
    return describe(_fp(s["inflight"])) if s["inflight"] else "issued outside shardlab's Comm"


def ranks_block(states: States) -> str:
    return "what each rank was doing (its last heartbeat):\n" + "\n".join(
        f"  {state_line(r, s)}" for r, s in sorted(states.items())
    )


def failure(rank: int, exc: BaseException, states: States) -> str:
    return (
        f"{HEADER}\ncause: rank {rank} failed with {error_line(exc)}\n{ranks_block(states)}\n"
        f"HINT: fix rank {rank}'s error (its log has the full traceback); the other ranks stopped because of it."
    )


def missing_rank(rank: int, s: dict[str, Any] | None, seq: int) -> str | None:
    """Why ``rank`` is not in collective ``#seq`` with the stuck rank, or None if it is."""
    if s is None or s["state"] != "running":
        return state_line(rank, s)
    inflight = _fp(s["inflight"])
    if s["blocked"] and inflight is not None and inflight[0] == seq:
        return None
    at = f" at {s['where']}" if s.get("where") else ""
    if s["blocked"]:
        return (
            f"rank {rank} is waiting in another collective, {_waited(s)}{at}: the ranks issued different"
            " collectives (one skipped or added one)"
        )
    if s["issued"] <= seq:
        return (
            f"rank {rank} never reached collective #{seq}: it has been running outside any collective for"
            f" {s['idle_s']:.1f} s{at} (its last: {describe(_fp(s['last']))})"
        )
    return (
        f"rank {rank} has already passed collective #{seq} (its last: {describe(_fp(s['last']))}){at}: the ranks"
        " issued different collectives (one skipped or added one)"
    )


def hang(rank: int, fingerprint: tuple | None, timeout_s: float, states: States) -> str:
    """``fingerprint``: this rank's oldest collective not yet finished (None: it waits in one issued outside
    shardlab's Comm, so the others cannot be compared by sequence number)."""
    if fingerprint is None:
        return (
            f"{HEADER}\ncause: rank {rank} waited more than collective_timeout_s={timeout_s:g} s in a collective"
            f" issued outside shardlab's Comm\n{ranks_block(states)}\nHINT: every rank must reach that"
            " collective (user code or a Lightning hook that runs on some ranks only?)."
        )
    seq = fingerprint[0]
    missing = {r: why for r, s in states.items() if r != rank and (why := missing_rank(r, s, seq)) is not None}
    if missing:
        who = f"missing: rank {', '.join(map(str, missing))}\n" + "\n".join(f"  {why}" for why in missing.values())
        hint = (
            "HINT: look at what the missing rank is doing (above): a data-dependent branch, an early exit or"
            " code under `if trainer.is_global_zero` that skips a unit or a collective on some ranks; run with"
            " strict_collectives=True to stop at the first differing collective."
        )
    else:
        who = f"every rank is waiting in collective #{seq}: the backend itself is stuck"
        hint = "HINT: check the network between the ranks and collectives issued outside shardlab (user code)."
    return (
        f"{HEADER}\ncause: rank {rank} waited more than collective_timeout_s={timeout_s:g} s in collective"
        f" {describe(fingerprint)}\n{who}\n{ranks_block(states)}\n{hint}"
    )


def death(gone: dict[int, str], states: States) -> str:
    lines = "\n".join(f"  rank {r}: {why}" for r, why in gone.items())
    last = "\n".join(f"  {state_line(r, states.get(r))}" for r in gone)
    return (
        f"{HEADER}\ncause: rank {', '.join(map(str, gone))} ended without reporting an error:\n{lines}\n"
        f"its last heartbeat said:\n{last}\n{ranks_block(states)}\n"
        "HINT: look for the reason outside Python: the out-of-memory killer (dmesg), a scheduler that killed the"
        " process, or a crash in native code (the rank's own log)."
    )


def store_lost(rank: int, error: BaseException) -> str:
    return (
        f"{HEADER}\ncause: rank {rank} lost the rendezvous store ({type(error).__name__}: {error}). The store"
        " lives in rank 0's process under env:// (torchrun's agent otherwise), so that process has ended.\n"
        "HINT: rank 0's log (or the launcher's) has the reason; if it was killed, look for the out-of-memory killer."
    )
