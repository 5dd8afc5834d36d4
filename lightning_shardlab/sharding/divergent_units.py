"""When ranks part at a unit's collective: say which unit ran where, and which module to make the unit.

A unit's all-gather (forward, backward) and reduce-scatter (its gradients) are issued by the ranks that
run it. When the ranks' verified fingerprints differ (comm/verify.py) and the calls are such unit
collectives, the cause is almost always a unit that ran on some ranks and not on others in this step, or
in another order: a data-dependent branch (mixture-of-experts routing, a block skipped for some inputs).
The fix is to gather it together with the code that decides whether it runs: make the enclosing block,
which runs on every rank, the unit. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_shardlab.comm.mismatch import Fingerprint, by_call
from lightning_shardlab.sharding.policy import CONTAINERS

VERBS = {"all_gather": "gathered", "reduce_scatter": "reduced the gradients of"}


def explain(
    root: nn.Module, units: dict[str, str], chosen_by_user: bool, each: dict[int, Fingerprint | None]
) -> str | None:
    """The hint for a mismatch of unit collectives, or None when the calls are not unit collectives.

    ``units``: flat parameter label (``experts.2[float32]``) -> the module path of its unit ("" for the root);
    ``chosen_by_user``: the units come from ``unit_classes`` (else from the default policy)."""
    parts, odd_unit = [], None
    for fp, ranks in by_call(each):
        unit = units.get(fp[2]) if fp is not None and fp[1] in VERBS else None
        who = f"rank {', '.join(map(str, ranks))}"
        if unit is None:
            parts.append(f"{who} issued {fp[1] if fp else 'nothing'}" + (f" {fp[2]!r}" if fp and fp[2] else ""))
            continue
        parts.append(f"{who} {VERBS[fp[1]]} unit {unit or 'root'!r}")
        odd_unit = unit  # groups come largest first: this ends on the fewest ranks' unit
    if odd_unit is None:
        return None
    return (
        f"{'; '.join(parts)}. A unit ran on some ranks and not on others in this step, or in another order (a"
        " data-dependent branch, such as mixture-of-experts routing): every rank must run each unit, or none may."
        f" Fix: {fix(root, odd_unit, chosen_by_user)}"
    )


def fix(root: nn.Module, unit: str, chosen_by_user: bool) -> str:
    """Which module should own ``unit``'s parameters: the nearest enclosing module that is not a container."""
    if not unit:
        return "make every rank run the same modules in the same order"
    cls = _class_path(root.get_submodule(unit))
    holder = _enclosing(root, unit)
    if holder:
        outer = root.get_submodule(holder)
        return (
            f"unit_classes=[{_class_path(outer)!r}] makes each {type(outer).__name__} (here {holder!r}) one unit, so"
            f" its {type(root.get_submodule(unit)).__name__} blocks are gathered together on every rank"
        )
    if chosen_by_user:
        return (
            f"leave {cls} out of unit_classes: its parameters then join the root unit, which every rank gathers"
            " for the whole step"
        )
    return (
        f"run the {cls} blocks in the same order on every rank (the default policy made them units because a"
        " loop runs every one of them), or name the units yourself in unit_classes"
    )


def _enclosing(root: nn.Module, path: str) -> str:
    parts: Sequence[str] = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:depth])
        if not isinstance(root.get_submodule(candidate), CONTAINERS):
            return candidate
    return ""


def _class_path(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"
