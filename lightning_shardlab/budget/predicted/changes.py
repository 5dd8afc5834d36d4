"""The cheapest single change: one that makes the step fit in device memory (``--device-memory``), or one that hides
its communication. Each change is planned, traced and timed as the setting itself is (setting.py), so one model of
a step, played on the engine's schedule (step_time.py), prices every one.

To fit, the rule tries, in this order (equal costs keep it):

1. a higher stage (2: gradients sharded; 3: parameters too, gathered per unit);
2. ``activation_checkpointing`` (every unit's modules keep only their inputs; backward recomputes them);
3. a smaller micro-batch b, with B / b gradient-accumulation steps keeping the global batch (the largest divisor of
   B that fits, else the smallest);
4. ``offload="cpu"``: masters and optimizer state in host memory (its transfers at ``--tier-link``);
5. a larger ``shard_group_size`` (the smallest that fits, else the largest).

Of those that lower the step's peak and fit, the one whose step is shortest is chosen.

When communication is exposed (more than 1 % of the step), these are timed, and the shortest step the engine offers
is named with what it saves:

1. another stage (off stage 3, ``reshard_after_forward`` back to True);
2. another ``shard_group_size`` (each divisor of the world; a group larger than a node runs on ``--inter``);
3. stage 3: another ``reshard_after_forward`` (False: no backward gathers; k: backward gathers among k ranks);
4. larger micro-batches, fewer of them, the same global batch; with one per step, twice the micro-batch, timed per
   the original global batch;
5. prefetching two units ahead: a what-if, shown but never chosen (the engine prefetches one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_shardlab.budget.predicted.plan import Plan
from lightning_shardlab.budget.predicted.setting import Setting
from lightning_shardlab.budget.predicted.step_timeline import PlannedPeak
from lightning_shardlab.core.config import Stage
from lightning_shardlab.core.display import size

EXPOSED_SHARE = 0.01  # changes are timed when communication exposes more than this share of the step
TRAINER = ("micro_batch_size", "accumulate_grad_batches")  # options that are the Trainer's and the data's


@dataclass(frozen=True)
class Try:
    """A change to make: what to set, and how its step differs besides the strategy options."""

    name: str  # e.g. "stage 3", "activation_checkpointing", "micro-batch 2 x 4 accumulation steps"
    options: dict[str, Any]  # the strategy options / Trainer arguments to set
    cost: str = ""  # what it adds, in words
    micro_batch_size: int | None = None
    micro_batches: int | None = None
    per: float = 1.0  # the share of its step the setting's global batch takes
    prefetch: int = 1
    available: bool = True  # False: a what-if the engine does not offer

    @property
    def strategy_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k not in TRAINER}


@dataclass
class Change:
    """A change made: the step it gives, what it adds over the setting, and with a memory limit its step's peak."""

    name: str
    options: dict[str, Any]
    step: float  # seconds per optimizer step at the setting's global batch
    comm_exposed: float  # seconds
    added_seconds: float  # over the setting's step, offload's host transfers included
    cost: str
    available: bool = True
    peak: PlannedPeak | None = None
    fits: bool | None = None

    def fields(self) -> dict[str, Any]:
        options = {k: int(v) if isinstance(v, Stage) else v for k, v in self.options.items()}
        peak = {**dataclasses.asdict(self.peak), "total": self.peak.total} if self.peak else None
        return {**dataclasses.asdict(self), "options": options, "peak": peak}


def made(setting: Setting, base: Plan, tried: Try, step: float, peak: PlannedPeak | None = None,
         limit: float | None = None) -> Change | None:  # fmt: skip
    """``tried`` planned and timed against the setting's ``step`` and plan ``base``; None when it is invalid."""
    changes = tried.strategy_options
    try:
        plan = setting.plan(**changes)
        out = setting.predict(tried.micro_batch_size, tried.micro_batches, tried.prefetch, **changes)
    except ValueError:  # groups that do not tile the world
        return None
    seconds = out["step"] * tried.per
    added = seconds - step + plan.tier_seconds - base.tier_seconds
    fits = peak.total <= limit if peak is not None and limit is not None else None
    return Change(tried.name, tried.options, seconds, out["comm_exposed"] * tried.per, added, tried.cost,
                  tried.available, peak, fits)  # fmt: skip


# ---- to fit ----


def fit_tries(setting: Setting, plan: Plan) -> list[list[Try]]:
    """The rule's changes in its order, in groups: of a group, the first whose step fits is made (else its last)."""
    b, m, world, group = setting.micro_batch_size, setting.micro_batches, setting.world_size, plan.shard_group_size
    stages = [
        [Try(f"stage {s}", {"stage": Stage(s)}, _moved(setting, plan, Stage(s)))] for s in range(plan.stage + 1, 4)
    ]
    checkpointed = setting.activations().checkpointed
    recompute = f"recompute: one more forward of {len(checkpointed)} modules"
    checkpointing = [] if setting.config.activation_checkpointing or not checkpointed else [
        [Try("activation_checkpointing", {"activation_checkpointing": True}, recompute)]
    ]  # fmt: skip
    repeated = "collectives repeated per micro-batch, the same FLOPs"
    smaller = [_accumulating(d, m * b // d, repeated) for d in range(b - 1, 0, -1) if b % d == 0]
    offload = [] if plan.offload != "none" or plan.whole_tensor is not None else [
        [Try("offload cpu", {"offload": "cpu"}, f"masters and optimizer state to and from the host ({plan.tier_link})")]
    ]  # fmt: skip
    larger = [
        _shard_group(g, world, f"{world // g} shard groups of {g} ranks")
        for g in range(group + 1, world + 1) if world % g == 0 and g % group == 0
    ]  # fmt: skip
    return [*stages, *checkpointing, smaller, *offload, larger]


def _accumulating(b: int, m: int, cost: str = "") -> Try:
    """Micro-batches of ``b`` sequences, ``m`` per optimizer step."""
    options = {"micro_batch_size": b, "accumulate_grad_batches": m}
    return Try(f"micro-batch {b} x {m} accumulation step{'s' if m > 1 else ''}", options, cost, b, m)


def _shard_group(g: int, world: int, cost: str = "") -> Try:
    return Try(f"shard_group_size {g}", {"shard_group_size": g if g < world else None}, cost)


def _moved(setting: Setting, plan: Plan, stage: Stage) -> str:
    """What ``stage`` moves per step beyond ``plan``, in words."""
    other = setting.plan(stage=stage)
    moved = sum(other.traffic[k] - plan.traffic[k] for k in ("all_gather_bytes", "reduce_scatter_bytes"))
    return f"{size(moved, decimal=True)} more moved per step" if moved > 0 else "no more traffic"


def _peak(setting: Setting, tried: Try) -> PlannedPeak | None:
    try:
        return setting.peak(setting.plan(**tried.strategy_options), tried.micro_batch_size, **tried.strategy_options)
    except ValueError:  # reshard_after_forward=k does not divide the group
        return None


def verdict(setting: Setting, plan: Plan, device_memory: float) -> dict[str, Any]:
    """Whether the step's peak fits in ``device_memory`` bytes; when not, every change of the rule that lowers it
    (``candidates``, in the rule's order) and the shortest step of those that fit (``choice``; None if none)."""
    now = setting.peak(plan)
    fields = {"device_memory": device_memory, "step_peak": now.total, "fits": now.total <= device_memory}
    if fields["fits"]:
        return {**fields, "choice": None, "candidates": []}
    step, tried = setting.predict()["step"], []
    for group in fit_tries(setting, plan):
        peaks = [(t, p) for t in group if (p := _peak(setting, t)) is not None]
        first = next(((t, p) for t, p in peaks if p.total <= device_memory), peaks[-1] if peaks else None)
        if first is not None and first[1].total < now.total:  # a change that does not lower the peak is none
            tried += [c for c in [made(setting, plan, first[0], step, first[1], device_memory)] if c]
    fitting = [c for c in tried if c.fits]
    choice = min(fitting, key=lambda c: c.added_seconds) if fitting else None  # min keeps the first of equals
    return {**fields, "choice": choice.name if choice else None, "candidates": [c.fields() for c in tried]}


def add_activations(plan: Plan, setting: Setting, device_memory: float | None) -> Plan:
    """The plan with the traced micro-batch, the step's peak and, given ``device_memory``, the verdict (``fits`` is
    then the step peak's)."""
    checkpointing = bool(setting.config.activation_checkpointing)
    plan.activations = {**setting.activations().fields(), "checkpointing": checkpointing}
    plan.step_peak = setting.peak(plan).fields()
    if device_memory is not None:
        plan.fit = verdict(setting, plan, device_memory)
        plan.fits = plan.fit["fits"]
    return plan


# ---- to hide communication ----


def time_tries(setting: Setting) -> list[Try]:
    """Every single change of the second rule above."""
    config, (_, group, _), world = setting.config, setting.changed(), setting.world_size
    back = {"reshard_after_forward": True} if config.reshard_after_forward is not True else {}
    tries = [
        Try(f"stage {int(s)}", {"stage": s, **(back if s is not Stage.PARAMETERS else {})})
        for s in Stage if s is not config.stage
    ]  # fmt: skip
    tries += [_shard_group(g, world) for g in range(1, world + 1) if world % g == 0 and g != group]
    if config.stage is Stage.PARAMETERS:
        now = config.reshard_after_forward
        values = [False, True, *(k for k in range(2, group) if group % k == 0)]
        tries += [
            Try(f"reshard_after_forward {v}", {"reshard_after_forward": v})
            for v in values if not (v == now and type(v) is type(now))
        ]  # fmt: skip
        tries.append(Try("prefetch 2 units ahead", {}, "what-if: the engine prefetches one unit", prefetch=2,
                         available=False))  # fmt: skip
    b, m = setting.micro_batch_size, setting.micro_batches
    if m == 1:
        tries.append(Try(f"micro-batch {2 * b}", {"micro_batch_size": 2 * b}, f"global batch x 2: timed per {b}"
                         " sequences", micro_batch_size=2 * b, per=0.5))  # fmt: skip
    return tries + [_accumulating(b * k, m // k) for k in range(2, m + 1) if m % k == 0]


def plan_time(setting: Setting) -> dict[str, Any]:
    """The setting's seconds per optimizer step; when communication is exposed, every change tried and the
    shortest (``choice``: of the changes the engine offers that shorten it; None when none does)."""
    now = setting.predict()
    if now["comm_exposed"] <= EXPOSED_SHARE * now["step"]:
        return now
    base = setting.plan()
    changes = [c for c in (made(setting, base, t, now["step"]) for t in time_tries(setting)) if c is not None]
    better = [c for c in changes if c.available and c.step < now["step"]]
    choice = min(better, key=lambda c: c.step) if better else None
    now["changes"] = [c.fields() for c in sorted(changes, key=lambda c: c.step)]
    now["choice"] = choice.fields() if choice else None
    return now
