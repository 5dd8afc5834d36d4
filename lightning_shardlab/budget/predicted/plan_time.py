"""A plan's time per step, and the cheapest change that hides its communication (``shardlab plan --micro-batch-size B
--seq-len T``), played as step_time.py plays a run's.

When communication is exposed (more than 1 % of the step), each single change below is timed the same way, and the
one with the smallest step is named with what it saves:

1. another stage (1, 2 or 3; off stage 3, ``reshard_after_forward`` back to True);
2. another ``shard_group_size`` (each divisor of the world; a group larger than a node runs on ``--inter``);
3. stage 3: another ``reshard_after_forward`` (False: no backward gathers; k: backward gathers among k ranks);
4. a larger micro-batch with fewer accumulation steps, keeping the global batch; with one micro-batch per step,
   twice the micro-batch, timed per the original global batch;
5. prefetching two units ahead: a what-if, shown but never chosen (the engine prefetches one).

Timed, not fitted: whether each fits in device memory is fits.py's question.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_shardlab.budget.predicted.compute_rate import ComputeRate
from lightning_shardlab.budget.predicted.compute_trace import (
    ComputeTrace,
    Work,
    master_sizes,
    optimizer_work,
    precision_copies,
    trace_plan_compute,
)
from lightning_shardlab.budget.predicted.optimizer_peak import planned_optimizer
from lightning_shardlab.budget.predicted.plan import PlannedModel, plan_policy
from lightning_shardlab.budget.predicted.step_time import Links, basis, predict_step_time
from lightning_shardlab.core.config import PrecisionPolicy, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout

EXPOSED_SHARE = 0.01  # changes are tried when communication exposes more than this share of the step


def planned_optimizer_work(name: str, layouts: list[FlatParamLayout], policy: PrecisionPolicy, foreach: bool) -> Work:
    """One step of torch's optimizer ``name`` (SGD with momentum; a whole-tensor optimizer as AdamW: its exchanges
    are not timed) over rank 0's master views, with the mixed-precision copies around it."""
    cls, options = planned_optimizer(name, foreach)
    copies = precision_copies(layouts, lambda lay: policy.compute_for(lay.dtype).itemsize)
    return optimizer_work(cls or torch.optim.AdamW, options, master_sizes(layouts)) + copies


@dataclass
class TimedSetting(PlannedModel):
    """What a plan's time was made from, so that a change is timed the same way."""

    rate: ComputeRate
    micro_batch_size: int
    seq_len: int
    micro_batches: int = 1  # per optimizer step (gradient accumulation)
    per_node: int | None = None
    data_seconds: float = 0.0
    link_share: float = 1.0  # what the links keep of their speed while compute runs (compute_rate.py's link_share)
    traces: dict[int, ComputeTrace] = field(default_factory=dict)

    def compute(self, micro_batch_size: int | None = None) -> ComputeTrace:
        """One micro-batch's work (default: the plan's size), each size traced once; ``ValueError`` if it fails."""
        b = micro_batch_size or self.micro_batch_size
        if b not in self.traces:
            self.traces[b] = trace_plan_compute(self.model, b, self.seq_len, self.precision, self.config)
        if self.traces[b].error:
            raise ValueError(
                f"{type(self.model).__name__} did not run one micro-batch ({b} x {self.seq_len}) under fake tensors:"
                f" {self.traces[b].error}. HINT: check --seq-len against the model's context."
            )
        return self.traces[b]

    def predict(
        self, micro_batch_size: int | None = None, micro_batches: int | None = None, prefetch: int = 1, **changes: Any
    ) -> dict[str, Any]:
        """Seconds per optimizer step with ``changes`` to the strategy options. ``ValueError`` for groups that do not
        tile the world."""
        config, group, reshard = self.changed(**changes)
        units, policy = self.units(config, group), plan_policy(self.precision, config)
        layouts = [lay for lays in units.values() for lay in lays]
        links = Links(self.link_inside(group), self.inter, self.world_size // group, reshard)
        m = micro_batches or self.micro_batches
        work = planned_optimizer_work(self.optimizer, layouts, policy, foreach=self.rate.device != "cpu")
        out = predict_step_time(
            units, self.compute(micro_batch_size), self.rate, config, policy, links,
            micro_batches=m, optimizer=work, data_seconds=self.data_seconds, prefetch=prefetch,
            link_share=self.link_share,
        )  # fmt: skip
        out["basis"] = {**basis(self.rate, links, m, self.precision, self.optimizer), "link_share": self.link_share}
        out["basis"]["micro_batch_size"] = micro_batch_size or self.micro_batch_size
        return out


@dataclass
class TimeChange:
    """One candidate: what to set, and the step it gives."""

    name: str  # e.g. "stage 2", "shard_group_size 8", "micro-batch 8 x 2 accumulation steps"
    options: dict[str, Any]  # the strategy options / Trainer arguments to set
    step: float  # seconds per optimizer step at the plan's global batch
    comm_exposed: float  # seconds
    available: bool = True  # False: a what-if the engine does not offer
    note: str = ""

    def fields(self) -> dict[str, Any]:
        options = {k: int(v) if isinstance(v, Stage) else v for k, v in self.options.items()}
        return {**dataclasses.asdict(self), "options": options}


def _try(setting: TimedSetting, name: str, options: dict[str, Any], per: float = 1.0, **how: Any) -> list[TimeChange]:
    """The change timed (``per``: the share of its step that the plan's global batch takes); [] when it is invalid."""
    changes = {k: v for k, v in options.items() if k not in ("micro_batch_size", "accumulate_grad_batches")}
    try:
        out = setting.predict(**how, **changes)
    except ValueError:
        return []
    return [TimeChange(name, options, out["step"] * per, out["comm_exposed"] * per)]


def _stages(setting: TimedSetting) -> list[TimeChange]:
    out = []
    for stage in (s for s in Stage if s is not setting.config.stage):
        options: dict[str, Any] = {"stage": stage}
        if stage is not Stage.PARAMETERS and setting.config.reshard_after_forward is not True:
            options["reshard_after_forward"] = True
        out += _try(setting, f"stage {int(stage)}", options)
    return out


def _groups(setting: TimedSetting) -> list[TimeChange]:
    world = setting.world_size
    _, group, _ = setting.changed()
    out = []
    for g in (g for g in range(1, world + 1) if world % g == 0 and g != group):
        out += _try(setting, f"shard_group_size {g}", {"shard_group_size": g if g < world else None})
    return out


def _resharding(setting: TimedSetting) -> list[TimeChange]:
    if setting.config.stage is not Stage.PARAMETERS:
        return []
    _, group, _ = setting.changed()
    now = setting.config.reshard_after_forward
    values = [False, True, *(k for k in range(2, group) if group % k == 0)]
    out = []
    for value in (v for v in values if not (v == now and type(v) is type(now))):
        out += _try(setting, f"reshard_after_forward {value}", {"reshard_after_forward": value})
    return out


def _micro_batches(setting: TimedSetting) -> list[TimeChange]:
    """Larger micro-batches, fewer of them, the same global batch; with one per step, twice the micro-batch."""
    b, m = setting.micro_batch_size, setting.micro_batches
    if m == 1:
        tried = _try(setting, f"micro-batch {2 * b}", {"micro_batch_size": 2 * b}, 0.5, micro_batch_size=2 * b)
        return [dataclasses.replace(c, note=f"global batch x 2: timed per {b} sequences") for c in tried]
    out = []
    for k in (k for k in range(2, m + 1) if m % k == 0):
        options = {"micro_batch_size": b * k, "accumulate_grad_batches": m // k}
        name = f"micro-batch {b * k} x {m // k} accumulation step{'s' if m // k > 1 else ''}"
        out += _try(setting, name, options, micro_batch_size=b * k, micro_batches=m // k)
    return out


def _prefetch(setting: TimedSetting) -> list[TimeChange]:
    if setting.config.stage is not Stage.PARAMETERS:
        return []
    tried = _try(setting, "prefetch 2 units ahead", {}, prefetch=2)
    return [dataclasses.replace(c, available=False, note="what-if: the engine prefetches one unit") for c in tried]


def plan_time(setting: TimedSetting) -> dict[str, Any]:
    """The plan's seconds per optimizer step; when communication is exposed, every change tried and the cheapest
    (``choice``: the smallest step of the changes the engine offers that shorten it; None when none does)."""
    now = setting.predict()
    if now["comm_exposed"] <= EXPOSED_SHARE * now["step"]:
        return now
    changes = [*_stages(setting), *_groups(setting), *_resharding(setting), *_micro_batches(setting)]
    changes += _prefetch(setting)  # every single change of the rule above, timed
    better = [c for c in changes if c.available and c.step < now["step"]]
    choice = min(better, key=lambda c: c.step) if better else None
    now["changes"] = [c.fields() for c in sorted(changes, key=lambda c: c.step)]
    now["choice"] = choice.fields() if choice else None
    return now
