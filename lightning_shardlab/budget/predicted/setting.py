"""One model planned under changes to its strategy options: its plan, its step's peak and its time per step, each
made the same way for the setting as given and for every change tried (budget/predicted/changes.py).

``shardlab plan --model X --micro-batch-size B --seq-len T`` makes one ``Setting``. Changing it (a stage, a shard
group, checkpointing, a micro-batch size, offload) lays the model out again (plan.py), runs its micro-batch on the
engine's schedule under fake tensors (step_timeline.py) and plays its step on the links (step_time.py); each trace
is made once per micro-batch size and setting.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_shardlab.budget.predicted.compute_rate import ComputeRate
from lightning_shardlab.budget.predicted.compute_trace import ComputeTrace, optimizer_work
from lightning_shardlab.budget.predicted.engine_schedule import UnitBytes
from lightning_shardlab.budget.predicted.fake_step import STEPS, token_batch
from lightning_shardlab.budget.predicted.forward_trace import ActivationTrace, ForwardTrace, trace_forward
from lightning_shardlab.budget.predicted.optimizer_peak import planned_optimizer, planned_step_temporaries
from lightning_shardlab.budget.predicted.plan import COMPUTE, Plan, plan_model, plan_policy
from lightning_shardlab.budget.predicted.step_time import basis, predict_step_time
from lightning_shardlab.budget.predicted.step_timeline import PlannedPeak, StepTimeline, step_timeline
from lightning_shardlab.budget.predicted.zero_table import Interconnect, Links
from lightning_shardlab.core.config import ShardLabConfig
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.policy import plan_units


@dataclass
class Setting:
    """A model's plan inputs; each method takes ``changes`` to the strategy options (``micro_batch_size`` and
    ``micro_batches`` apart)."""

    model: torch.nn.Module
    config: ShardLabConfig
    world_size: int
    precision: str
    optimizer: str
    intra: Interconnect  # the link inside shard groups
    inter: Interconnect  # the link across them
    source: str
    micro_batch_size: int
    seq_len: int
    rate: ComputeRate  # how fast a rank computes (compute_rate.py): given, or measured here
    micro_batches: int = 1  # per optimizer step (gradient accumulation)
    per_node: int | None = None  # the ranks of one node
    tier_link: str | None = None
    data_seconds: float = 0.0
    link_share: float = 1.0  # what the links keep of their speed while compute runs (compute_rate.py's link_share)
    traces: dict[Any, Any] = field(default_factory=dict)  # what each trace gave, by micro-batch size and setting

    def changed(self, **changes: Any) -> tuple[ShardLabConfig, int, int | None]:
        """(the config with ``changes``, its shard group size, its reshard group size)."""
        config = dataclasses.replace(self.config, **changes)
        return config, *config.group_sizes(self.world_size, self.per_node or self.world_size)

    def units(self, config: ShardLabConfig, group: int) -> dict[str, list[FlatParamLayout]]:
        return plan_units(self.model, config, group).layouts()

    def link_inside(self, group: int) -> Interconnect:
        """The link inside a shard group of ``group`` ranks: ``inter`` once the group is larger than a node."""
        return self.inter if group > (self.per_node or self.world_size) else self.intra

    def _once(self, key: tuple, make: Any) -> Any:
        if key not in self.traces:
            self.traces[key] = make()
        return self.traces[key]

    def plan(self, device_memory: float | None = None, **changes: Any) -> Plan:
        config, group, _ = self.changed(**changes)
        link, inter = self.link_inside(group), self.inter
        make = functools.partial(
            plan_model, self.model, config, self.world_size, self.precision, self.optimizer, link, self.source,
            inter=inter, per_node=self.per_node, tier_link=self.tier_link, device_memory=device_memory,
        )  # fmt: skip
        return self._once(("plan", link, inter, device_memory, *sorted(changes.items())), make)

    def trace(self, micro_batch_size: int | None = None) -> ForwardTrace:
        """One micro-batch's forward, what it saves and does (forward_trace.py); ``Untraced`` if it does not run."""
        b = micro_batch_size or self.micro_batch_size
        make = functools.partial(trace_forward, self.model, b, self.seq_len, self.precision, config=self.config)
        return self._once(("trace", b), make)

    def activations(self, micro_batch_size: int | None = None) -> ActivationTrace:
        """What one micro-batch saves, without and with checkpointing."""
        return self.trace(micro_batch_size).activations

    def compute(self, micro_batch_size: int | None = None, **changes: Any) -> ComputeTrace:
        """One micro-batch's work by unit, the checkpointed modules' recomputation with it if ``changes`` check
        point."""
        config, _, _ = self.changed(**changes)
        return self.trace(micro_batch_size).work.checkpointed(bool(config.activation_checkpointing))

    def timeline(self, micro_batch_size: int | None = None, **changes: Any) -> StepTimeline:
        """One micro-batch's live bytes on the engine's schedule (step_timeline.py; NCCL: no receive rooms)."""
        b = micro_batch_size or self.micro_batch_size

        def make() -> StepTimeline:
            config, group, reshard = self.changed(**changes)
            policy = plan_policy(self.precision, config)
            sizes = {
                name: UnitBytes.of(lays, config.stage, policy, reshard_size=reshard)
                for name, lays in self.units(config, group).items()
            }
            batch = functools.partial(token_batch, self.model, b, self.seq_len)
            return step_timeline(self.model, config, sizes, batch, STEPS[self.activations(b).step], self.precision)

        return self._once(("timeline", b, *sorted(changes.items())), make)

    def optimizer_bytes(self, **changes: Any) -> int:
        """The optimizer step's temporaries on the device (none offloaded; optimizer_peak.py)."""

        def make() -> int:
            config, group, _ = self.changed(**changes)
            layouts = [lay for lays in self.units(config, group).values() for lay in lays]
            on_device = config.offload == "none"
            mixed = COMPUTE[self.precision] is not None
            return planned_step_temporaries(self.optimizer, layouts, mixed) if on_device else 0

        return self._once(("optimizer", *sorted(changes.items())), make)

    def peak(self, plan: Plan, micro_batch_size: int | None = None, **changes: Any) -> PlannedPeak:
        """``plan``'s device-resident state (``plan`` made with ``changes``) with the busiest moment of the step: of
        a micro-batch of ``micro_batch_size``, or of the optimizer's step."""
        timeline = self.timeline(micro_batch_size, **changes)
        moment, _ = timeline.busiest(self.optimizer_bytes(**changes), "the optimizer's step")
        return PlannedPeak.at(plan.device_bytes - plan.gathered_peak, moment, float)

    def predict(
        self, micro_batch_size: int | None = None, micro_batches: int | None = None, prefetch: int = 1, **changes: Any
    ) -> dict[str, Any]:
        """Seconds per optimizer step (step_time.py), each setting played once. ``ValueError`` for groups that do not
        tile the world."""
        b, m = micro_batch_size or self.micro_batch_size, micro_batches or self.micro_batches

        def make() -> dict[str, Any]:
            config, group, reshard = self.changed(**changes)
            units, policy = self.units(config, group), plan_policy(self.precision, config)
            layouts = [lay for lays in units.values() for lay in lays]
            links = Links(self.link_inside(group), self.inter, self.world_size // group, reshard, group)
            cls, options = planned_optimizer(self.optimizer, foreach=self.rate.device != "cpu")
            work = optimizer_work(cls or torch.optim.AdamW, options, layouts, policy)  # a whole-tensor one: as AdamW
            out = predict_step_time(
                units, self.compute(b, **changes), self.rate, config, policy, links,
                micro_batches=m, optimizer=work, data_seconds=self.data_seconds, prefetch=prefetch,
                link_share=self.link_share,
            )  # fmt: skip
            out["basis"] = {**basis(self.rate, links, m, self.precision, self.optimizer), "link_share": self.link_share}
            out["basis"]["micro_batch_size"] = b
            return out

        key = ("time", b, m, prefetch, self.rate, self.link_share, self.intra, self.inter, *sorted(changes.items()))
        return dict(self._once(key, make))
