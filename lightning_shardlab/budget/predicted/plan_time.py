"""A plan's time per step, and the cheapest change that hides its communication (``shardlab plan --micro-batch-size B
--seq-len T``).

The plan's model is laid out at the target world size (sharding/policy.py, on the meta device), one micro-batch of
it traced for its work (budget/predicted/compute_trace.py) and the optimizer's step for its bytes, and the step
played on the engine's schedule over the plan's links at a compute rate (budget/predicted/step_time.py;
budget/predicted/compute_rate.py: a named device x ``--mfu``, ``--flops`` given, or ``--flops here``, measured).

When communication is exposed (more than 1 % of the step), each single change below is planned and played the same
way, and the one with the smallest step time is named with what it saves:

1. another stage (1, 2 or 3; off stage 3, ``reshard_after_forward`` back to True);
2. another ``shard_group_size`` (each divisor of the world; a group larger than a node runs on ``--inter``);
3. stage 3: another ``reshard_after_forward`` (False: no backward gathers, parameters held from forward to
   backward; k: backward gathers among k ranks);
4. a larger micro-batch with fewer accumulation steps, keeping the global batch (more compute per gather); with one
   micro-batch per step, twice the micro-batch, timed per the original global batch;
5. prefetching two units ahead: a what-if, shown but never chosen (the engine prefetches one).

The changes are timed, not fitted: whether each fits in device memory is the step peak's question
(budget/predicted/fits.py, ``--device-memory``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_shardlab.budget.predicted.compute_rate import ComputeRate
from lightning_shardlab.budget.predicted.compute_trace import (
    ComputeTrace,
    Work,
    master_sizes,
    optimizer_work,
    precision_copies,
    trace_plan_compute,
)
from lightning_shardlab.budget.predicted.optimizer_peak import elementwise_class
from lightning_shardlab.budget.predicted.plan import COMPUTE, Plan
from lightning_shardlab.budget.predicted.step_time import PARTS, Links, basis, predict_step_time, traffic_seconds
from lightning_shardlab.budget.predicted.zero_table import Interconnect, Traffic
from lightning_shardlab.core.config import REDUCE_DTYPES, PrecisionPolicy, ShardLabConfig, Stage
from lightning_shardlab.sharding.flat_param import FlatParamLayout
from lightning_shardlab.sharding.policy import plan_units

EXPOSED_SHARE = 0.01  # changes are tried when communication exposes more than this share of the step


def planned_optimizer_work(name: str, layouts: list[FlatParamLayout], policy: PrecisionPolicy, foreach: bool) -> Work:
    """One step of torch's optimizer ``name`` (SGD with momentum; a whole-tensor optimizer as AdamW: its exchanges
    are not timed) over rank 0's master views, with the mixed-precision copies around it."""
    cls = elementwise_class(name) or torch.optim.AdamW
    options: dict[str, Any] = {"foreach": foreach, **({"momentum": 0.9} if cls is torch.optim.SGD else {})}
    copies = precision_copies(layouts, lambda lay: policy.compute_for(lay.dtype).itemsize)
    return optimizer_work(cls, options, master_sizes(layouts)) + copies


@dataclass
class TimedSetting:
    """What a plan's time was made from, so that a change is timed the same way."""

    model: nn.Module
    config: ShardLabConfig
    world_size: int
    precision: str
    optimizer: str
    intra: Interconnect
    inter: Interconnect
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
        config = dataclasses.replace(self.config, **changes)
        per_node = self.per_node or self.world_size
        group, reshard = config.group_sizes(self.world_size, per_node)
        units = plan_units(self.model, config, group).layouts()
        reduce = REDUCE_DTYPES[config.reduce_dtype] if config.reduce_dtype else None
        policy = PrecisionPolicy(COMPUTE[self.precision], reduce)
        layouts = [lay for lays in units.values() for lay in lays]
        links = Links(self.inter if group > per_node else self.intra, self.inter, self.world_size // group, reshard)
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
    group, _ = setting.config.group_sizes(world, setting.per_node or world)
    out = []
    for g in (g for g in range(1, world + 1) if world % g == 0 and g != group):
        out += _try(setting, f"shard_group_size {g}", {"shard_group_size": g if g < world else None})
    return out


def _resharding(setting: TimedSetting) -> list[TimeChange]:
    if setting.config.stage is not Stage.PARAMETERS:
        return []
    group, _ = setting.config.group_sizes(setting.world_size, setting.per_node or setting.world_size)
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


def time_changes(setting: TimedSetting) -> list[TimeChange]:
    """Every single change of the rule above, timed."""
    return [*_stages(setting), *_groups(setting), *_resharding(setting), *_micro_batches(setting), *_prefetch(setting)]


def plan_time(setting: TimedSetting) -> dict[str, Any]:
    """The plan's seconds per optimizer step; when communication is exposed, every change tried and the cheapest
    (``choice``: the smallest step of the changes the engine offers that shorten it; None when none does)."""
    now = setting.predict()
    if now["comm_exposed"] <= EXPOSED_SHARE * now["step"]:
        return now
    changes = time_changes(setting)
    better = [c for c in changes if c.available and c.step < now["step"]]
    choice = min(better, key=lambda c: c.step) if better else None
    now["changes"] = [c.fields() for c in sorted(changes, key=lambda c: c.step)]
    now["choice"] = choice.fields() if choice else None
    return now


def comm_only_time(plan: Plan, intra: Interconnect, inter: Interconnect) -> dict[str, Any]:
    """What a plan without a traced micro-batch can time: each collective kind's seconds on the wire."""
    links = Links(intra, inter, plan.replicas, plan.reshard_size)
    return {
        "by_collective": traffic_seconds(Traffic(**plan.traffic), plan.shard_group_size, links),
        "note": "compute, and so what hides behind it, needs a model: --model or --config with --micro-batch-size"
        " and --seq-len",
    }


# ---- what the command prints ----


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def time_rows(time: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, seconds, share of the step) rows: the parts, the hidden communication, each collective kind."""
    labels = {"comm_exposed": "comm exposed", "waiting_for_ranks": "waiting for ranks (assumed 0)"}
    share = {part: f"{time[part] / max(time['step'], 1e-12):.0%}" for part in (*PARTS, "step")}
    rows = [(labels.get(part, part), _ms(time[part]), share[part]) for part in (*PARTS, "step")]
    rows.append(("comm hidden (in flight while computing)", _ms(time["comm_hidden"]), ""))
    for kind, entry in time["by_collective"].items():
        rows.append((f"  {kind}: on the wire / exposed", f"{_ms(entry['seconds'])} / {_ms(entry['exposed'])}", ""))
    return rows


def basis_line(time: dict[str, Any]) -> str:
    basis = time["basis"]
    across = f", across groups {basis['inter']}" if basis["inter"] else ""
    engine = sum(basis.get("engine_seconds", {}).values())
    costs = f" ({basis['seconds_per_op'] * 1e6:.1f} us a kernel" + (
        f", the engine's hooks {engine * 1e6:.0f} us a unit and step)" if engine else ")"
    )
    share = f" at {basis['link_share']:.2f} of its speed while computing" if basis.get("link_share", 1.0) < 1 else ""
    return (
        f"compute at {basis['rate']}{costs}; link {basis['link']}{across}{share}; {basis['micro_batches']}"
        f" micro-batch(es) of {basis['micro_batch_size']} per step"
    )


def change_rows(time: dict[str, Any]) -> list[tuple[str, ...]]:
    """(change, step, comm exposed, vs now, note) rows, fastest first, the chosen one marked."""
    choice = (time.get("choice") or {}).get("name")
    return [
        (c["name"] + (" (chosen)" if c["name"] == choice else ""), _ms(c["step"]), _ms(c["comm_exposed"]),
         f"{(c['step'] - time['step']) * 1e3:+,.1f} ms", c["note"])
        for c in time.get("changes", [])
    ]  # fmt: skip


def choice_line(time: dict[str, Any]) -> str:
    """The cheapest change that hides communication, and what it saves."""
    choice = time.get("choice")
    if choice is None:
        return "cheapest change that hides communication: none of these shortens the step"
    saved = time["step"] - choice["step"]
    return (
        f"cheapest change that hides communication: {choice['name']} (step {_ms(choice['step'])}, {_ms(saved)} less,"
        f" -{saved / time['step']:.0%})"
    )
