"""Does one step fit on the device, and if not, the cheapest change that makes it fit (``shardlab plan
--micro-batch-size B --seq-len T --device-memory 80GB``).

The step's peak per rank: the plan's device-resident state + the busiest moment of one micro-batch's step
(step_timeline.py; NCCL: no receive rooms) or of the optimizer's. Each candidate change is planned and run the same way:

1. a higher stage (2: gradients sharded; 3: parameters too, gathered per unit);
2. ``activation_checkpointing`` (every unit's modules keep only their inputs);
3. a smaller micro-batch b, with B / b gradient-accumulation steps keeping the global batch (b divides B);
4. ``offload="cpu"``: masters and optimizer state in host memory;
5. a larger ``shard_group_size`` (hybrid runs: fewer replicas, more ranks sharing the model).

The chosen one fits at the least time it adds per optimizer step (a lower bound on the plan's links and ``--device``
x ``--mfu``; a smaller micro-batch's less efficient matmuls not modelled). Equal costs keep the order above.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from lightning_shardlab.budget.predicted.activation_trace import STEPS, ActivationTrace, token_batch, trace_activations
from lightning_shardlab.budget.predicted.optimizer_peak import planned_step_temporaries
from lightning_shardlab.budget.predicted.plan import COMPUTE, Plan, PlannedModel, link_seconds, plan_model, plan_policy
from lightning_shardlab.budget.predicted.step_timeline import PlannedPeak, StepTimeline, UnitBytes, step_timeline
from lightning_shardlab.budget.predicted.zero_table import DEVICES, predict_traffic
from lightning_shardlab.core.config import Accumulation, Stage
from lightning_shardlab.core.display import size


def _gb(n: float) -> str:
    return size(n, decimal=True)


def step_peak(setting: Setting, plan: Plan, micro_batch_size: int | None = None, **changes: Any) -> PlannedPeak:
    """``plan``'s device-resident state with the busiest moment of the setting's step with ``changes`` to the
    strategy options (the ones ``plan`` was made with) and a micro-batch of ``micro_batch_size``."""
    timeline = setting.timeline(micro_batch_size, **changes)
    moment, _ = timeline.busiest(setting.optimizer_bytes(**changes), "the optimizer's step")
    return PlannedPeak.at(plan.device_bytes - plan.gathered_peak, moment, float)


@dataclass
class Change:
    """One candidate: what to set, the step peak it gives, and what it costs per optimizer step."""

    name: str  # e.g. "stage 3", "activation_checkpointing", "micro-batch 2 x 4 accumulation steps"
    options: dict[str, Any]  # the strategy options / Trainer arguments to set
    peak: PlannedPeak
    fits: bool
    added_seconds: float  # lower bound per optimizer step
    cost: str  # the added work, in words

    def fields(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak": {**dataclasses.asdict(self.peak), "total": self.peak.total}}


@dataclass
class Setting(PlannedModel):
    """What a model's plan was made from, so that a change is planned (and traced) the same way."""

    source: str
    micro_batch_size: int
    seq_len: int
    per_node: int | None = None
    tier_link: str | None = None
    device: str = "h100"  # for the recomputation's time
    mfu: float = 0.4
    traces: dict[int, ActivationTrace] = field(default_factory=dict)
    timelines: dict[tuple, Any] = field(default_factory=dict)  # step timelines, and optimizer steps' bytes

    @property
    def checkpointing(self) -> bool:
        return bool(getattr(self.config, "activation_checkpointing", False))

    def plan(self, device_memory: float | None = None, **changes: Any) -> Plan:
        """The plan with ``changes`` to the strategy options."""
        config, group, _ = self.changed(**changes)
        return plan_model(
            self.model, config, self.world_size, self.precision, self.optimizer, self.link_inside(group), self.source,
            inter=self.inter, per_node=self.per_node, tier_link=self.tier_link, device_memory=device_memory,
        )  # fmt: skip

    def trace(self, micro_batch_size: int | None = None) -> ActivationTrace:
        """One micro-batch of ``micro_batch_size`` (default: the plan's) traced; each size once."""
        b = micro_batch_size or self.micro_batch_size
        if b not in self.traces:
            self.traces[b] = trace_activations(self.model, b, self.seq_len, self.precision, config=self.config)
        return self.traces[b]

    def timeline(self, micro_batch_size: int | None = None, **changes: Any) -> StepTimeline:
        """One micro-batch's step on the engine's schedule with ``changes`` to the strategy options; each once."""
        b = micro_batch_size or self.micro_batch_size
        key = (b, *sorted(changes.items()))
        if key not in self.timelines:
            config, group, reshard = self.changed(**changes)
            policy = plan_policy(self.precision, self.config)
            sizes = {
                name: UnitBytes.of(lays, config.stage, policy, reshard_size=reshard)
                for name, lays in self.units(config, group).items()
            }
            step = STEPS[self.trace(b).step]
            make = functools.partial(token_batch, self.model, b, self.seq_len)
            self.timelines[key] = step_timeline(self.model, config, sizes, make, step, self.precision)
        return self.timelines[key]

    def optimizer_bytes(self, **changes: Any) -> int:
        """The optimizer step's temporaries on the device with ``changes`` (none offloaded); each setting once."""
        key = ("optimizer", *sorted(changes.items()))
        if key not in self.timelines:
            config, group, _ = self.changed(**changes)
            layouts = [lay for lays in self.units(config, group).values() for lay in lays]
            mixed = COMPUTE[self.precision] is not None
            on_device = config.offload == "none"
            self.timelines[key] = planned_step_temporaries(self.optimizer, layouts, mixed) if on_device else 0
        return self.timelines[key]

    def accumulation_seconds(self, plan: Plan, steps: int) -> float:
        """What ``steps`` micro-batches per optimizer step add over one on the plan's links: the collectives
        repeated per micro-batch (stage 3's gathers; the reductions with accumulation='reduce')."""
        group, reshard, replicas = plan.shard_group_size, plan.reshard_size, plan.replicas
        units, policy = self.units(self.config, group), plan_policy(self.precision, self.config)

        def seconds(micro: int) -> float:
            traffic = predict_traffic(
                units, self.config.stage, policy, micro_batches=micro,
                reduce_every_micro_batch=self.config.accumulation is Accumulation.REDUCE,
                reshard_after_forward=self.config.reshard_after_forward, replicas=replicas, reshard_size=reshard,
            )  # fmt: skip
            return sum(link_seconds(traffic, group, reshard, replicas, self.link_inside(group), self.inter).values())

        return seconds(steps) - seconds(1)

    def recompute_seconds(self, trace: ActivationTrace, micro_batch_size: int) -> float:
        """One more forward of the checkpointed modules: 2 FLOPs per parameter per token of the micro-batch."""
        params = {id(p): p.numel() for name in trace.checkpointed for p in self.model.get_submodule(name).parameters()}
        return 2 * sum(params.values()) * micro_batch_size * self.seq_len / (DEVICES[self.device] * self.mfu)


@dataclass
class Verdict:
    device_memory: float
    peak: PlannedPeak
    fits: bool
    candidates: list[Change]  # every change tried, in the order of the rule (the cheapest that fits is chosen)
    choice: Change | None  # the cheapest change that fits; None when the step fits already, or nothing fits

    def fields(self) -> dict[str, Any]:
        return {
            "device_memory": self.device_memory,
            "step_peak": self.peak.total,
            "fits": self.fits,
            "choice": self.choice.name if self.choice else None,
            "candidates": [c.fields() for c in self.candidates],
        }


Tried = tuple[str, dict, PlannedPeak, float, str]  # (name, options, step peak, added seconds, cost in words)


def candidates(setting: Setting, plan: Plan, device_memory: float) -> list[Change]:
    """Every single change of the rule that lowers this plan's step peak, with that peak and its added cost (see
    above); of the smaller micro-batches and larger shard groups, the first that fits (else the last)."""
    trace = setting.trace()
    now = step_peak(setting, plan).total
    tried = [
        *_higher_stages(setting, plan),
        *_checkpointing(setting, plan, trace),
        *_smaller_micro_batch(setting, plan, device_memory),
        *_offload(setting, plan),
        *_larger_shard_group(setting, plan, device_memory),
    ]
    return [
        Change(name, options, peak, peak.total <= device_memory, max(seconds, 0.0), cost)
        for name, options, peak, seconds, cost in tried
        if peak.total < now  # a change that does not lower the peak is no candidate
    ]


def _higher_stages(setting: Setting, plan: Plan) -> list[Tried]:
    out = []
    for stage in range(plan.stage + 1, 4):
        other = setting.plan(stage=Stage(stage))
        moved = sum(other.traffic[k] - plan.traffic[k] for k in ("all_gather_bytes", "reduce_scatter_bytes"))
        out.append((
            f"stage {stage}", {"stage": stage}, step_peak(setting, other, stage=Stage(stage)),
            other.comm_seconds - plan.comm_seconds,
            f"{_gb(max(moved, 0))} more moved per step" if moved > 0 else "no more traffic",
        ))  # fmt: skip
    return out


def _checkpointing(setting: Setting, plan: Plan, trace: ActivationTrace) -> list[Tried]:
    if setting.checkpointing or not trace.checkpointed:
        return []
    return [(
        "activation_checkpointing", {"activation_checkpointing": True},
        step_peak(setting, plan, activation_checkpointing=True),
        setting.recompute_seconds(trace, setting.micro_batch_size),
        f"recompute: one more forward of {len(trace.checkpointed)} modules (~1/3 of their forward + backward"
        f" FLOPs; {setting.device} at {setting.mfu:.0%} MFU)",
    )]  # fmt: skip


def _smaller_micro_batch(setting: Setting, plan: Plan, device_memory: float) -> list[Tried]:
    """The largest divisor of the micro-batch whose step fits (else the smallest), with the accumulation that keeps
    the global batch."""
    b = setting.micro_batch_size
    divisors = [d for d in range(b - 1, 0, -1) if b % d == 0]
    for i, smaller in enumerate(divisors):
        peak = step_peak(setting, plan, smaller)
        if peak.total <= device_memory or i == len(divisors) - 1:
            steps = b // smaller
            return [(
                f"micro-batch {smaller} x {steps} accumulation steps",
                {"micro_batch_size": smaller, "accumulate_grad_batches": steps}, peak,
                setting.accumulation_seconds(plan, steps),
                f"{steps - 1} more micro-batch{'es' if steps > 2 else ''} per step: collectives repeated,"
                " the same FLOPs",
            )]  # fmt: skip
    return []


def _offload(setting: Setting, plan: Plan) -> list[Tried]:
    if plan.offload != "none" or plan.whole_tensor is not None:
        return []
    other = setting.plan(offload="cpu")
    return [(
        "offload cpu", {"offload": "cpu"}, step_peak(setting, other, offload="cpu"),
        other.tier_seconds + other.comm_seconds - plan.comm_seconds,
        f"{_gb(other.tier_moves['down'] + other.tier_moves['up'])} to and from the host per step ({other.tier_link})",
    )]  # fmt: skip


def _larger_shard_group(setting: Setting, plan: Plan, device_memory: float) -> list[Tried]:
    """The smallest larger shard group whose step fits (else the largest)."""
    group, world = plan.shard_group_size, setting.world_size
    larger = [g for g in range(group + 1, world + 1) if world % g == 0 and g % group == 0]
    for i, g in enumerate(larger):
        try:
            other = setting.plan(shard_group_size=g if g < world else None)
        except ValueError:  # reshard_after_forward=k does not divide it
            continue
        peak = step_peak(setting, other, shard_group_size=g if g < world else None)
        if peak.total <= device_memory or i == len(larger) - 1:
            return [(
                f"shard_group_size {g}", {"shard_group_size": g if g < world else None}, peak,
                other.comm_seconds - plan.comm_seconds,
                f"{world // g} shard groups of {g} ranks: collectives over more ranks",
            )]  # fmt: skip
    return []


def verdict(setting: Setting, plan: Plan, device_memory: float) -> Verdict:
    """Whether the plan's step peak fits in ``device_memory`` bytes; when not, the cheapest single change that
    fits (the rule above), every change tried listed with its peak and cost."""
    peak = step_peak(setting, plan)
    if peak.total <= device_memory:
        return Verdict(device_memory, peak, True, [], None)
    tried = candidates(setting, plan, device_memory)
    fitting = [c for c in tried if c.fits]
    choice = min(fitting, key=lambda c: c.added_seconds) if fitting else None  # min keeps the first of equals
    return Verdict(device_memory, peak, False, tried, choice)


def add_activations(plan: Plan, setting: Setting, device_memory: float | None) -> Plan:
    """The plan with the traced micro-batch, the step peak and, given ``device_memory``, the verdict (``fits`` is
    then the step peak's)."""
    trace = setting.trace()
    checkpointing = setting.checkpointing
    peak = step_peak(setting, plan)
    plan.activations = {**trace.fields(), "checkpointing": checkpointing}
    plan.step_peak = peak.fields()
    if device_memory is not None:
        judged = verdict(setting, plan, device_memory)
        plan.fit = judged.fields()
        plan.fits = judged.fits
    return plan
