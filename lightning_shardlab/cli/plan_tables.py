"""``shardlab plan``'s tables: bytes per rank, traffic, activations and the step peak, whole-tensor owners, time
per step and the changes tried (cli/plan.py reads the inputs and runs the plan; this file prints it)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES
from lightning_shardlab.budget.measured.tiers import plan_rows
from lightning_shardlab.budget.predicted.plan import Plan
from lightning_shardlab.budget.predicted.step_time import PARTS
from lightning_shardlab.budget.predicted.zero_table import Traffic
from lightning_shardlab.core.display import print_table, size


def _gb(n: float) -> str:
    return size(n, decimal=True)  # as hardware is sold


def _grouping(plan: Plan) -> str:
    """'64 ranks = 8 shard groups x 8 ranks' (hybrid), or '64 ranks'; with reshard groups of k."""
    text = f"{plan.world_size} ranks"
    if plan.replicas > 1:
        text += f" = {plan.replicas} shard groups x {plan.shard_group_size} ranks"
    if plan.reshard_size:
        text += f", backward gathers in reshard groups of {plan.reshard_size}"
    return text


def print_plan(plan: Plan, console: Console) -> None:
    """Per-rank bytes, bytes moved per step inside and across groups, and the time on each link."""
    traffic = Traffic(**plan.traffic)
    table = Table(title=f"shardlab plan: {plan.source}")
    table.add_column("")
    table.add_column("per rank", justify="right")
    for cat in MEMORY_CATEGORIES:
        if cat != "error_feedback" or plan.memory_per_rank.get(cat):  # a row only where int8 reductions keep one
            table.add_row(cat, _gb(plan.memory_per_rank.get(cat, 0.0)))
    table.add_row("model state per rank", _gb(plan.model_state))
    table.add_row("unsharded (one device)", _gb(plan.unsharded_bytes))
    if plan.gathered_peak:
        table.add_row("gathered units at peak", _gb(plan.gathered_peak))
    for label, value in activation_rows(plan):
        table.add_row(label, value)
    hybrid = plan.replicas > 1
    inside = "moved per step in each shard group (full tensors)" if hybrid else "moved per step (full tensors)"
    table.add_row(inside, _gb(traffic.scope_bytes("world", "shard", rings=True)))
    if plan.reshard_size:
        table.add_row("moved per step in each reshard group (full tensors)", _gb(traffic.scope_bytes("reshard")))
    if hybrid:
        table.add_row("moved per step across shard groups (all-reduced shards)", _gb(traffic.scope_bytes("replica")))
        table.add_row(f"intra-group link >= ({plan.links['intra']})", _ms(plan.link_seconds["intra"]))
        table.add_row(f"inter-group link >= ({plan.links['inter']})", _ms(plan.link_seconds["inter"]))
        table.add_row("communication >= (both links)", _ms(plan.comm_seconds))
    else:
        table.add_row(f"communication >= ({plan.interconnect})", _ms(plan.comm_seconds))
    fields = asdict(plan)
    if plan.step_peak is not None:  # the verdict is the step peak's (below), not the model state's alone
        fields["device_memory"] = None
    for label, value in [*whole_rows(plan.whole_tensor, plan.world_size), *plan_rows(fields)]:
        table.add_row(label, _gb(value) if isinstance(value, float) else value)
    if plan.compute_seconds is not None:
        verdict = "hides behind compute" if plan.comm_seconds <= plan.compute_seconds else "exceeds compute"
        table.add_row("compute per step (estimate)", _ms(plan.compute_seconds))
        table.add_row("communication", verdict)
    print_table(console, table)
    if plan.options:
        print_table(console, options_table(plan))
    console.print(
        f"{plan.params:,} parameters, stage {plan.stage}, {_grouping(plan)}, {plan.precision}", soft_wrap=True
    )
    print_fit(plan, console)
    if plan.whole_tensor:
        console.print(
            f"{plan.whole_tensor['recipe']}; each parameter {plan.whole_tensor['optimizer']} steps is stepped whole"
            " on one owner rank, which alone keeps its state: per step one all-to-all gathers its averaged gradient"
            " pieces (and values, unless the owner holds the parameter whole), one returns the new values.",
            soft_wrap=True,
        )


def options_table(plan: Plan) -> Table:
    """Each fewer-bytes option against the exact run: bytes moved per step, communication on the plan's links, and
    the time saved per step (budget/predicted/option_savings.py)."""
    link = plan.interconnect if plan.replicas == 1 else "both links"
    table = Table(
        title=f"shardlab plan: the fewer-bytes options per step on {link} (lower bounds)",
        caption="saved: communication time only; packing and unpacking cost compute (docs/slow_links.md)",
    )
    for col in ("option", "moved per step", "communication >=", "saved per step"):
        table.add_column(col, justify="left" if col == "option" else "right")
    for row in plan.options or []:
        table.add_row(row["option"], _gb(row["bytes"]), _ms(row["comm_seconds"]), _ms(row["saved_seconds"]))
    return table


def activation_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, text) rows for a traced micro-batch: what it saves, the largest unit, the step peak, the verdict."""
    acts, peak = plan.activations, plan.step_peak
    if acts is None or peak is None:
        return []
    ckpt = acts["checkpointing"]
    by_unit = acts["checkpointed_by_unit" if ckpt else "by_unit"]
    units = {k: v for k, v in by_unit.items() if k != "root"}
    shape = f"{acts['micro_batch_size']} x {acts['seq_len']}"
    ckpt_text = f", {len(acts['checkpointed'])} modules checkpointed" if ckpt else ""
    total = acts["checkpointed_total" if ckpt else "total"]
    rows = [(f"saved for backward (micro-batch {shape}{ckpt_text}; traced)", _gb(total))]
    rows.append(("  of which the root unit", _gb(by_unit.get("root", 0))))
    if units:
        largest = max(units, key=units.get)
        rows.append((f"  the largest unit ({largest}; {len(units)} units)", _gb(units[largest])))
    if ckpt:
        rows.append(("recompute peak (largest checkpointed module, in backward)", _gb(acts["recompute_peak"])))
    rows.append(("live at the step's busiest moment (traced)", _gb(peak["traced"])))
    rows.append(("  gathered then / in flight then", f"{_gb(peak['gathered'])} / {_gb(peak['in_flight'])}"))
    rows.append(("step peak per rank", _gb(peak["total"])))
    if plan.fit is not None:
        rows.append((f"in {plan.fit['device_memory'] / 1e9:,.0f} GB of device memory", _verdict(plan.fit)))
    return rows


def _verdict(fit: dict[str, Any]) -> str:
    if fit["fits"]:
        return "fits"
    return f"does not fit; cheapest change: {fit['choice']}" if fit["choice"] else "does not fit; no single change fits"


def print_fit(plan: Plan, console: Console) -> None:
    """The step peak as arithmetic, and with --device-memory every change tried, the cheapest that fits marked."""
    if plan.step_peak is None:
        return
    console.print(f"step peak per rank: {plan.step_peak['arithmetic']}", soft_wrap=True)
    if plan.fit is None or plan.fit["fits"]:
        return
    table = Table(title=f"changes that fit the step in {_gb(plan.fit['device_memory'])} (cheapest first)")
    for col in ("change", "step peak", "fits", "added per step", "cost"):
        table.add_column(col, justify="left" if col in ("change", "cost") else "right")
    ordered = sorted(plan.fit["candidates"], key=lambda c: (not c["fits"], c["added_seconds"]))
    for c in ordered:
        mark = " (chosen)" if c["name"] == plan.fit["choice"] else ""
        table.add_row(
            c["name"] + mark, _gb(c["peak"]["total"]), "yes" if c["fits"] else "no", _ms(c["added_seconds"]), c["cost"]
        )
    print_table(console, table)


def whole_rows(whole: dict[str, Any] | None, world_size: int) -> list[tuple[str, float | str]]:
    """(label, bytes or text) rows for a whole-tensor optimizer: the fullest owner, the 1/W ideal, the exchanges."""
    if not whole:
        return []
    name, fullest, busiest = whole["optimizer"], whole["fullest_rank"], whole["busiest_rank"]
    owned = f"{fullest['owned_params']:,} parameters, " if whole["params"] else ""
    share = fullest["owned_numel"] / max(whole["numel"], 1)
    return [
        (
            f"{name}: owned by the fullest rank ({fullest['rank']})",
            f"{owned}{fullest['owned_numel']:,.0f} of {whole['numel']:,.0f} elements ({share:.1%}; 1/W"
            f" {1 / world_size:.1%})",
        ),
        (f"{name} state of the fullest rank (whole tensors)", float(fullest["state_bytes"])),
        (f"{name} state per rank, the 1/W ideal", float(whole["ideal_state_bytes_per_rank"])),
        (
            f"all-to-all per step: {whole['calls_per_step']} calls, sent by the busiest rank ({busiest['rank']})",
            float(busiest["gather_bytes"] + busiest["return_bytes"]),
        ),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def print_time(time: dict[str, Any], console: Console) -> None:
    """The time per step: its parts, by collective kind, and (communication exposed) the changes tried; without
    compute, each collective's time on the wire."""
    if "step" not in time:
        rows = [(kind, _ms(entry["seconds"])) for kind, entry in time["by_collective"].items()]
        _rows_table(console, "time per step: communication", ("collective", "on the wire >="), rows)
        console.print(time["note"], soft_wrap=True)
        return
    _rows_table(console, "time per step (predicted)", ("", "per step", "share"), time_rows(time))
    console.print(basis_line(time), soft_wrap=True)
    if "changes" in time:
        title = f"changes that hide communication ({_ms(time['comm_exposed'])} exposed of {_ms(time['step'])})"
        _rows_table(console, title, ("change", "step", "comm exposed", "vs now", "cost"), change_rows(time))
        console.print(choice_line(time), soft_wrap=True)


def _rows_table(console: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 or col == "cost" else "right")
    for row in rows:
        table.add_row(*row)
    print_table(console, table)


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
    """(change, step, comm exposed, vs now, cost) rows, fastest first, the chosen one marked."""
    choice = (time.get("choice") or {}).get("name")
    return [
        (c["name"] + (" (chosen)" if c["name"] == choice else ""), _ms(c["step"]), _ms(c["comm_exposed"]),
         f"{(c['step'] - time['step']) * 1e3:+,.1f} ms", c["cost"])
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
