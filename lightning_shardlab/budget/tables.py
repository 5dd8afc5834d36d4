"""The budget's tables, printed by rank 0 when fit ends: every rank's figures, measured (predicted).

Memory per rank by category, a line on the units (what stage 3 gathers at a time, and which option made
them), communication per step by collective (all_to_all: the bytes this rank sends), by group for hybrid or
regrouped runs, the offload tiers, what the owners of whole-tensor optimizers (Muon, Adafactor) hold and
exchange (budget/predicted/whole_tensor.py), the activations saved for backward by unit
(budget/measured/activations.py), time per step by part (budget/measured/step_time.py) with the stragglers, the
error each fewer-bytes option brings, and each one's bytes and communication time per step on the link the run
probed for itself (budget/predicted/option_savings.py).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_shardlab.budget.measured.memory import MEMORY_CATEGORIES
from lightning_shardlab.budget.measured.tiers import tier_table
from lightning_shardlab.comm.mesh import SCOPES
from lightning_shardlab.core.display import mib, print_table, size

OPTIONS_CAPTION = (
    "lower bounds on the run's own link (rings: (N-1)/N of the bytes over its bandwidth, N-1 latencies a call);"
    " saved: communication time only, packing and unpacking cost compute (docs/slow_links.md)"
)


def print_budget(console: Console, everyone: list[dict[str, Any]]) -> None:
    """All of rank 0's tables, from every rank's report (budget/report.py)."""
    first = everyone[0]
    print_table(console, memory_table(everyone))
    console.print(units_line(first))
    print_table(console, comm_table(everyone))
    if any(scope != "world" for r in everyone for scope in r["comm_per_step_by_scope"]):
        print_table(console, scope_table(everyone))
    if first["offload"] != "none":
        print_table(console, tier_table(everyone))
    if any(r.get("whole_tensor") for r in everyone):
        print_table(console, whole_tensor_table(everyone))
    if any(r.get("activations_measured") for r in everyone):
        print_table(console, activations_table(everyone))
    if any(r.get("step_peak_measured") for r in everyone):
        print_table(console, step_peak_table(everyone))
    if first.get("option_error"):
        print_table(console, option_error_table(first["option_error"]))
    if first.get("option_savings"):
        print_table(console, option_savings_table(first["option_savings"]))
    if any(r.get("time_measured") for r in everyone):
        print_table(console, time_table(everyone))
        for straggler in everyone[0].get("stragglers", []):
            console.print(f"[rank 0] straggler: {straggler['message']}")


TIME_COLUMNS = ("step", "forward", "backward", "optimizer", "data", "comm_exposed", "waiting_for_ranks", "comm_hidden")


def time_table(everyone: list[dict[str, Any]]) -> Table:
    """Each rank's seconds per optimizer step by part, in ms, measured (predicted); comm_hidden overlaps the rest."""
    first = everyone[0]
    table = Table(
        title=f"shardlab budget: time per optimizer step ({first.get('time_steps', 0)} steps), ms,"
        " measured (predicted)",
        caption="forward + backward + optimizer + data + comm exposed + waiting for ranks = the step;"
        " comm hidden is in flight while computing (overlapped, not added)",
    )
    for col in ("rank", *TIME_COLUMNS):
        table.add_column(col.replace("_", " "), justify="right")
    for r in everyone:
        measured, predicted = r.get("time_measured") or {}, r.get("time_predicted") or {}
        as_measured = {"data"} if str(predicted.get("basis", {}).get("data", "")).startswith("as measured") else set()
        cells = [
            f"{measured.get(k, 0.0) * 1e3:.1f}"
            + (" (as measured)" if k in as_measured else f" ({predicted[k] * 1e3:.1f})" if k in predicted else "")
            for k in TIME_COLUMNS
        ]
        table.add_row(str(r["rank"]), *cells)
    why = next((p.get("why") or p["error"] for r in everyone if "error" in (p := r.get("time_predicted") or {})), None)
    if why:
        table.caption += f"; not predicted: {why}"
    return table


def memory_table(everyone: list[dict[str, Any]]) -> Table:
    first = everyone[0]
    table = Table(
        title=f"shardlab budget: memory per rank between steps, MiB measured (predicted), stage {first['stage']},"
        f" {first['world_size']} ranks, {first['precision']}"
    )
    cats = (*shown_categories(everyone), "gathered_peak")
    for col in ("rank", *cats, "model state", "process peak"):
        table.add_column(col, justify="right")
    for r in everyone:
        m, p = r["memory_measured"], r["memory_predicted"]
        cells = [f"{mib(m[c])} ({mib(p[c])})" for c in cats]
        state = sum(m[c] for c in MEMORY_CATEGORIES if c != "padding")
        predicted = sum(p[c] for c in MEMORY_CATEGORIES if c != "padding")
        table.add_row(str(r["rank"]), *cells, f"{mib(state)} ({mib(predicted)})", mib(r["process_peak_bytes"]))
    return table


def shown_categories(everyone: list[dict[str, Any]]) -> tuple[str, ...]:
    """The memory categories to show: all but ``error_feedback`` where no rank keeps or expects a residual (the
    defaults' table stays as it was)."""
    kept = any(r[side].get("error_feedback", 0) for r in everyone for side in ("memory_measured", "memory_predicted"))
    return tuple(c for c in MEMORY_CATEGORIES if kept or c != "error_feedback")


def option_error_table(figures: dict[str, Any]) -> Table:
    """Per unit, over every rank: the error a fewer-bytes option brings (budget/measured/option_error.py)."""
    table = Table(
        title="shardlab budget: the error each fewer-bytes option brings, per unit, over every rank",
        caption="gather: the weights every rank computes with against the fp32 masters, as fit ended; reduce: the"
        " reduced gradient against an exact fp32 reduction, sampled (last sampled step; worst relative L2 of all)",
    )
    for col in ("option", "unit", "max |error|", "relative L2", "worst relative L2", "sampled steps"):
        table.add_column(col, justify="right")
    for unit, e in (figures.get("gather") or {}).items():
        table.add_row("int8 gathers", unit, f"{e['max_abs']:.3g}", f"{e['rel_l2']:.3g}", "-", "-")
    reduce = figures.get("reduce")
    if reduce and reduce["by_step"]:
        last, steps = reduce["by_step"][-1], reduce["steps"]
        sampled = f"{len(steps)}, one in {reduce['every']}"
        for unit, e in last.items():
            worst = max(step.get(unit, {}).get("rel_l2", 0.0) for step in reduce["by_step"])
            table.add_row(
                "packed reduction", unit, f"{e['max_abs']:.3g}", f"{e['rel_l2']:.3g}", f"{worst:.3g}", sampled
            )
    return table


def option_savings_table(savings: dict[str, Any]) -> Table:
    """Each fewer-bytes option against the exact run, per optimizer step on the link this run probed: bytes moved,
    communication, and the time saved (budget/predicted/option_savings.py); the run's own choice marked."""
    inter = savings.get("inter")
    link = savings["link"]["name"] + (f"; across shard groups {inter['name']}" if inter else "")
    table = Table(
        title=f"shardlab budget: the fewer-bytes options per optimizer step on this run's link ({link})",
        caption=OPTIONS_CAPTION,
    )
    for col in ("option", "MiB moved", "communication >=, ms", "saved, ms"):
        table.add_column(col, justify="left" if col == "option" else "right")
    for row in savings["rows"]:
        name = row["option"] + (" (this run)" if row.get("this_run") else "")
        table.add_row(name, mib(row["bytes"]), f"{row['comm_seconds'] * 1e3:.3f}", f"{row['saved_seconds'] * 1e3:.3f}")
    return table


def units_line(report: dict[str, Any]) -> str:
    """One line: the units, what the stage does with them, and the option that made them."""
    units = report["units"]
    total, blocks = sum(units.values()), {n: p for n, p in units.items() if n != "root"}
    names = ", ".join(blocks) if len(blocks) <= 6 else f"{', '.join(list(blocks)[:3])}, ... {list(blocks)[-1]}"
    made = f"made by {report['unit_policy']}"
    if report["stage"] != 3:
        return (
            f"units: the root + {len(blocks)} ({names or 'none'}; {made}); stage {report['stage']} keeps every"
            " parameter whole on every rank, so nothing is gathered per unit."
        )
    if not blocks:
        return (
            f"units: 1, the whole model ({total:,} parameters; {made}): stage 3 gathers all of it at once."
            " HINT: unit_classes=[YourBlock] (or unit_bucket_params=0) gathers one block at a time."
        )
    calls = report["comm_predicted_per_step"].get("all_gather_calls")
    if report["reshard_after_forward"] is False:
        return (
            f"units: the root + {len(blocks)} ({names}; {made}): stage 3 with reshard_after_forward=False gathers"
            f" each before its forward and keeps it until its backward ({calls} all-gathers per step)."
        )
    return (
        f"units: the root ({units.get('root', 0):,} parameters) + {len(blocks)} ({names}; {made}; largest"
        f" {max(blocks.values()):,} of {total:,} parameters): stage 3 gathers each just before it computes and"
        f" frees it after ({calls} all-gathers per step), so the gathered peak is the root and two units"
        " (one computing, the next prefetched), not the whole model."
    )


def comm_table(everyone: list[dict[str, Any]]) -> Table:
    first = everyone[0]
    table = Table(
        title=f"shardlab budget: communication per optimizer step ({first['optimizer_steps']} steps),"
        " full-tensor MiB, measured (predicted)",
        caption="all_to_all (whole-tensor optimizers' exchanges): the MiB this rank sends"
        if any("all_to_all" in r["comm_per_step"] for r in everyone)
        else None,
    )
    for col in ("rank", "collective", "calls", "MiB", "seconds waiting", "share of step"):
        table.add_column(col, justify="right")
    for r in everyone:
        pred = r["comm_predicted_per_step"]
        for kind, c in sorted(r["comm_per_step"].items()):
            p_calls, p_bytes = pred.get(f"{kind}_calls"), pred.get(f"{kind}_bytes")
            calls = f"{c['calls']:.1f}" + (f" ({p_calls})" if p_calls is not None else "")
            moved = mib(c["bytes"]) + (f" ({mib(p_bytes)})" if p_bytes is not None else "")
            share = c["seconds"] / max(r["step_seconds"], 1e-12)
            table.add_row(str(r["rank"]), kind, calls, moved, f"{c['seconds']:.4f}", f"{share:.1%}")
    return table


def scope_table(everyone: list[dict[str, Any]]) -> Table:
    """Hybrid or regrouped runs: the same calls by the group they ran in (comm/mesh.py's scopes)."""
    table = Table(
        title="shardlab budget: communication per optimizer step by group, full-tensor MiB, measured (predicted)"
    )
    for col in ("rank", "group", "collective", "calls", "MiB", "seconds waiting"):
        table.add_column(col, justify="right")
    for r in everyone:
        predicted = r["comm_predicted_per_step"].get("by_scope", {})
        for scope, kinds in sorted(r["comm_per_step_by_scope"].items()):
            for kind, c in sorted(kinds.items()):
                p = predicted.get(scope, {}).get(kind)
                calls = f"{c['calls']:.1f}" + (f" ({p[0]})" if p is not None else "")
                moved = mib(c["bytes"]) + (f" ({mib(p[1])})" if p is not None else "")
                group = f"{scope}: {SCOPES.get(scope, scope)}"
                table.add_row(str(r["rank"]), group, kind, calls, moved, f"{c['seconds']:.4f}")
    return table


def whole_tensor_table(everyone: list[dict[str, Any]]) -> Table:
    """Per rank, over its whole-tensor optimizers: the parameters it owns, the state it keeps for them, and the
    all-to-alls per step it takes part in (a gather and a return per master dtype), measured (predicted)."""
    table = Table(
        title="shardlab budget: whole-tensor optimizers, each parameter stepped whole on its owner rank: the state"
        " of what it owns, all-to-alls per optimizer step, measured (predicted)",
        caption="sent: what this rank sends (gathers: averaged gradient pieces, and values unless the owner holds"
        " them whole; returns: the new values to every holder)",
    )
    for col in ("rank", "optimizer", "owned params", "owned elements", "share", "state", "all-to-alls", "sent"):
        table.add_column(col, justify="right")
    for r in everyone:
        opts = r.get("whole_tensor") or []
        if not opts:
            continue
        owned, total = sum(o["owned_numel"] for o in opts), sum(o["total_numel"] for o in opts)
        state = [sum(o[f"state_bytes_{side}"] for o in opts) for side in ("measured", "predicted")]
        measured = r["comm_per_step"].get("all_to_all", {"calls": 0.0, "bytes": 0.0})
        predicted = r["comm_predicted_per_step"]
        table.add_row(
            str(r["rank"]),
            ", ".join(o["optimizer"] for o in opts),
            f"{sum(o['owned'] for o in opts)} of {sum(o['params'] for o in opts)}",
            f"{owned:,} of {total:,}",
            f"{owned / max(total, 1):.1%} (1/W {1 / r['world_size']:.1%})",
            f"{size(state[0])} ({size(state[1])})",
            f"{measured['calls']:.1f} ({predicted.get('all_to_all_calls', 0):.1f})",
            f"{size(measured['bytes'])} ({size(predicted.get('all_to_all_bytes', 0))})",
        )
    return table


def activations_table(everyone: list[dict[str, Any]]) -> Table:
    """Per rank: the bytes autograd saved for backward in the largest forward of a step, by unit (each storage
    once), beside the model state it adds to (budget/measured/activations.py)."""
    table = Table(
        title="shardlab budget: activations saved for backward at the peak forward, MiB measured (predicted: the"
        " first batch traced under fake tensors); storages counted once, parameters and gathered buffers are model"
        " state",
        caption="checkpointed units keep only their inputs; their forward is recomputed in backward",
    )
    for col in ("rank", "activations (predicted)", "model state", "root", "units (largest first)", "checkpointed"):
        table.add_column(col, justify="right")
    for r in everyone:
        act = r.get("activations_measured") or {}
        units = {n: b for n, b in act.get("by_unit", {}).items() if n != "root"}
        largest = sorted(units.items(), key=lambda item: -item[1])
        shown = ", ".join(f"{n} {mib(b)}" for n, b in largest[:4]) + (
            f", +{len(largest) - 4}" if len(largest) > 4 else ""
        )
        state = sum(v for k, v in r["memory_measured"].items() if k in MEMORY_CATEGORIES and k != "padding")
        table.add_row(
            str(r["rank"]),
            f"{mib(act.get('total', 0))} ({_predicted(r)})",
            mib(state),
            mib(act.get("by_unit", {}).get("root", 0)),
            shown or "-",
            str(len(act.get("checkpointed", []))),
        )
    return table


def step_peak_table(everyone: list[dict[str, Any]]) -> Table:
    """Per rank and phase of one step: the largest total of live tensors, and what it was made of."""
    table = Table(
        title="shardlab budget: the step's peak of tensor memory by phase (the first step after the warm-up), MiB"
        " measured, and the step's peak predicted",
        caption="made of, on CPU: what was live as the step started (the real tensors) and what the step had made"
        " by its peak (every allocation and free); on a GPU the allocator's peak. predicted: the layout's state +"
        " the busiest moment of the first batch run under fake tensors on the engine's schedule",
    )
    for col in ("rank", "phase", "peak", "made of"):
        table.add_column(col, justify="right")
    for r in everyone:
        for phase, figures in (r.get("step_peak_measured") or {}).items():
            parts = sorted(figures["by_category"].items(), key=lambda item: -item[1])
            made = ", ".join(f"{name} {mib(nbytes)}" for name, nbytes in parts) or "-"
            table.add_row(str(r["rank"]), phase, mib(figures["peak"]), made)
        predicted = r.get("step_peak_predicted")
        if predicted:
            table.add_row(str(r["rank"]), "step (predicted)", mib(predicted["total"]), predicted["arithmetic"])
    return table


def _predicted(report: dict[str, Any]) -> str:
    """The traced prediction of the activations total, or why there is none."""
    predicted = report.get("activations_predicted") or {}
    if "total" in predicted:
        return mib(predicted["total"])
    return f"not traced: {predicted.get('why') or predicted.get('error', '')}" if predicted else "-"
