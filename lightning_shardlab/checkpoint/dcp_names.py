"""Matching a Distributed Checkpoint's names to the module's, as the source wrote them. Pure.

A DCP checkpoint keys every tensor by its path in the state dict its writer saved, flattened with dots:
``model.blocks.0.attn.qkv.weight`` (torch's tutorial layout ``{"model": ..., "optim": ...}``),
``state_dict.blocks.0.attn.qkv.weight`` (Lightning's FSDP and ModelParallel strategies, and ours), or the bare
module names (torchtitan). The module that wrote it may also have been wrapped (a LightningModule holding the
network as ``self.model``: one more ``model.``), or compiled (``torch.compile`` puts ``_orig_mod.`` into every
name). So a saved key is ``P + n`` for one of the module's names ``Q + n``: ``P`` a prefix of the saved keys,
``Q`` a prefix every name of the module shares, and ``_orig_mod.`` ignored on both sides. The pair chosen is the
one that matches the most parameters (ties: the shorter prefixes), so one rule reads every layout above, and a
checkpoint of another model matches nothing and is refused with the first names on each side.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

COMPILED = "_orig_mod"  # the segment torch.compile's OptimizedModule adds to every name


def plain(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` segments."""
    return ".".join(part for part in name.split(".") if part != COMPILED)


def shared_prefixes(names: Iterable[str]) -> list[str]:
    """``""`` and each run of leading segments that every name shares, shortest first (``model.``, ...)."""
    split = [n.split(".") for n in names]
    out = [""]
    if not split:
        return out
    for depth in range(1, min(map(len, split))):
        head = split[0][:depth]
        if any(s[:depth] != head for s in split):
            break
        out.append(".".join(head) + ".")
    return out


def match(ours: Sequence[Sequence[str]], saved: Iterable[str]) -> tuple[list[str | None], str]:
    """For each of ours (all its names: a tied parameter has several, the first is canonical), the saved key it
    is, or None; and the saved keys' prefix that was chosen."""
    by_plain: dict[str, str] = {}
    suffixes: dict[str, set[str]] = {}  # a saved key's tail after any dot -> the prefixes it follows
    for key in saved:
        p = plain(key)
        by_plain.setdefault(p, key)
        parts = p.split(".")
        for i in range(len(parts)):
            suffixes.setdefault(".".join(parts[i:]), set()).add(".".join(parts[:i]) + "." if i else "")
    plains = [[plain(n) for n in names] for names in ours]
    best: tuple[int, int, str, str] | None = None  # (matched, -len(P + Q), P, Q)
    for q in shared_prefixes(n for names in plains for n in names):
        counts: dict[str, int] = {}
        for names in plains:
            found = {p for n in names for p in suffixes.get(n[len(q) :], ())}
            for p in found:
                counts[p] = counts.get(p, 0) + 1
        for p, n in counts.items():
            candidate = (n, -len(p + q), p, q)
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    if best is None:
        return [None] * len(ours), ""
    _, _, p, q = best
    out = []
    for names in plains:
        key = next((by_plain[p + n[len(q) :]] for n in names if p + n[len(q) :] in by_plain), None)
        out.append(key)
    return out, p


def mismatch(what: str, missing: Sequence[str], unused: Sequence[str], where: str, hint: str) -> str:
    """The message of a name mismatch: the first names on each side."""
    return (
        f"the DCP checkpoint {where} does not match the {what}: not in the checkpoint {list(missing[:5])}"
        f"{' ...' if len(missing) > 5 else ''}; in the checkpoint but not matched {list(unused[:5])}"
        f"{' ...' if len(unused) > 5 else ''}. HINT: {hint}"
    )
