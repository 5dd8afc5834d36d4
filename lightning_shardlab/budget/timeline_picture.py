"""The budget's time side as a picture: one steady training step of every rank, on one clock.

Each report's ``timeline`` (the measuring side's record of one steady optimizer step, on a clock shared by all
ranks) becomes two files, written by rank 0 beside ``shardlab_budget.json``:

- ``shardlab_timeline.png`` (``write_timeline_png``, when matplotlib is installed: the ``plot`` extra): one lane per
  rank, rank 0 on top, time in milliseconds. A lane's upper row, "compute", is the rank's main thread: forward and
  backward by unit (blues and oranges, one shade per unit, the unit's name on its bar when it fits), the optimizer,
  data loading, and, hatched in red, where the thread was blocked: ``comm_exposed`` (waiting on a collective whose
  data had not arrived) and ``waiting_for_ranks`` (waiting because another rank came later). The lower row, "comm",
  holds the collectives in flight from launch to completion, semi-transparent, so what overlaps compute shows.
  Drawn on a ``Figure`` of its own, like bars.py: nothing global changes in the user's process.
- ``shardlab_timeline.trace.json`` (``write_chrome_trace``): the same events in the Chrome trace event format, one
  process per rank with the threads "compute" (tid 0) and "comm" (tid 1). Open it in Perfetto (ui.perfetto.dev,
  "Open trace file") or in Chrome at chrome://tracing ("Load"). A thread's complete events must nest, so an event
  that would overlap another on its thread without nesting (two collectives in flight at once) moves to an extra
  thread of its lane, "comm 2" (tid 2 or above); ``args`` carries ``lane`` and whatever else the event holds.

Below the ranks, both draw the step rank 0 predicted for itself (its report's ``time_predicted``: the engine's
schedule played on the time model, budget/predicted/step_time.py), on the same scale from 0: lane "predicted" in the
picture, process "predicted" in the trace.

A report without a timeline (a run of one step) is left out of both; with none at all there is no picture and the
trace holds no events.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

PNG_NAME = "shardlab_timeline.png"
TRACE_NAME = "shardlab_timeline.trace.json"

FORWARD = ("#1f4e99", "#3b7dd8", "#6aa5ea", "#2c6cb0")  # one shade per unit, cycled
BACKWARD = ("#b34700", "#e6731a", "#f5a05a", "#cc5c0a")
COMPUTE = {"optimizer": "#2e9e44", "data": "#8a63c4", "other": "#9a9a9a"}
COLLECTIVES = {
    "all_gather": "#17a2b8", "reduce_scatter": "#b8a617", "all_reduce": "#d6479e",
    "all_to_all": "#6d7f3a", "broadcast": "#8c564b",
}  # fmt: skip
BLOCKED = {
    "comm_exposed": {"facecolor": "#f4a3a3", "edgecolor": "#c00000", "hatch": "////"},
    "waiting_for_ranks": {"facecolor": "#fcd7d7", "edgecolor": "#e03030", "hatch": "xxx"},
}
NEUTRAL = "#b5b5b5"  # a cat this module does not know
LEGEND = ("forward", "backward", "optimizer", "data", "other", *COLLECTIVES, *BLOCKED)
LABELLED = ("forward", "backward", "optimizer", "data", "other")  # compute bars that carry their name
NEST_SLACK = 1e-9  # seconds: an end this close to its parent's counts as inside it


def timelines(reports: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``(rank, timeline)`` of every report that has one, by rank."""
    return sorted(((int(r["rank"]), r["timeline"]) for r in reports if r.get("timeline")), key=lambda p: p[0])


def predicted_timeline(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The step rank 0 predicted for itself, as a timeline (None without one)."""
    first = next((r for r in reports if int(r.get("rank", -1)) == 0), None)
    return ((first or {}).get("time_predicted") or {}).get("timeline")


def lane_of(event: dict[str, Any]) -> str:
    """The event's lane: its own, else "comm" for a collective kind and "compute" for the rest."""
    return event.get("lane") or ("comm" if event.get("cat") in COLLECTIVES else "compute")


def name_of(event: dict[str, Any]) -> str:
    """The event's name (its cat when it has none)."""
    return str(event.get("name") or event.get("cat", "other"))


def _target(path: Path, name: str) -> Path:
    path = Path(path)
    return path / name if path.is_dir() else path


# --- the Chrome trace ------------------------------------------------------------------------------------------


def _fits(stack: list[float], start: float, end: float) -> bool:
    """Whether [start, end) nests in a thread whose open events end at ``stack`` (outermost first)."""
    while stack and stack[-1] <= start + NEST_SLACK:
        stack.pop()
    return not stack or end <= stack[-1] + NEST_SLACK


def threads(events: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[int]]]:
    """Each event's tid (0 compute, 1 comm; 2 and above for one that would overlap its lane's without nesting) and
    each lane's tids, its own first."""
    open_ends: dict[int, list[float]] = defaultdict(list)
    lanes: dict[str, list[int]] = {"compute": [0], "comm": [1]}
    tids = [0] * len(events)
    order = sorted(range(len(events)), key=lambda i: (events[i]["start"], -events[i]["dur"]))
    for i in order:
        start, end = events[i]["start"], events[i]["start"] + events[i]["dur"]
        lane = "comm" if lane_of(events[i]) == "comm" else "compute"
        tid = next((t for t in lanes[lane] if _fits(open_ends[t], start, end)), None)
        if tid is None:
            tid = max(lanes["compute"] + lanes["comm"]) + 1
            lanes[lane].append(tid)
        open_ends[tid].append(end)
        tids[i] = tid
    return tids, lanes


def _thread_name(tid: int, lanes: dict[str, list[int]]) -> str:
    lane = "comm" if tid in lanes["comm"] else "compute"
    place = lanes[lane].index(tid)
    return lane if place == 0 else f"{lane} {place + 1}"


def _metadata(rank: int, lanes: dict[str, list[int]], name: str = "") -> list[dict[str, Any]]:
    meta = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name or f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    for tid in sorted(lanes["compute"] + lanes["comm"]):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": _thread_name(tid, lanes)}}
        )
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return meta


def trace_events(rank: int, timeline: dict[str, Any], name: str = "") -> list[dict[str, Any]]:
    """One rank's metadata (its process ``name``: "rank r" unless given), then its complete events (microseconds) in
    the order given."""
    events = list(timeline.get("events", ()))
    tids, lanes = threads(events)
    complete = []
    for event, tid in zip(events, tids):
        args = {k: v for k, v in event.items() if k not in ("name", "cat", "start", "dur")}
        args["lane"] = lane_of(event)
        complete.append({
            "name": name_of(event), "cat": event.get("cat", "other"), "ph": "X", "ts": event["start"] * 1e6,
            "dur": event["dur"] * 1e6, "pid": rank, "tid": tid, "args": args,
        })  # fmt: skip
    return _metadata(rank, lanes, name) + complete


def write_chrome_trace(reports: list[dict[str, Any]], path: Path) -> Path:
    """Write every rank's timeline as a Chrome trace (``path``, or ``path/shardlab_timeline.trace.json``)."""
    path = _target(path, TRACE_NAME)
    events, steps = [], {}
    lines = timelines(reports)
    for rank, timeline in lines:
        events += trace_events(rank, timeline)
        steps[str(rank)] = {"step": timeline.get("step"), "step_seconds": timeline.get("step_seconds")}
    predicted = predicted_timeline(reports)
    if lines and predicted:
        events += trace_events(max(rank for rank, _ in lines) + 1, predicted, "predicted")
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": steps}}
    if lines and predicted:
        trace["otherData"]["predicted"] = {"step_seconds": predicted.get("step_seconds")}
    path.write_text(json.dumps(trace))
    return path


# --- the picture -------------------------------------------------------------------------------------------------


def unit_shades(lines: list[tuple[int, dict[str, Any]]]) -> dict[str, int]:
    """Each unit's shade index, by first appearance in forward or backward (rank 0 first): a unit keeps its index
    in both families."""
    shades: dict[str, int] = {}
    for _, timeline in lines:
        for event in timeline.get("events", ()):
            if event.get("cat") in ("forward", "backward"):
                shades.setdefault(name_of(event), len(shades))
    return shades


def style(event: dict[str, Any], shades: dict[str, int]) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The event's legend label and its bar's look (matplotlib keyword arguments, as sorted pairs)."""
    cat = event.get("cat", "other")
    if cat in BLOCKED:
        look = {**BLOCKED[cat], "linewidth": 0.6, "zorder": 3}
    elif lane_of(event) == "comm":
        colour = COLLECTIVES.get(cat, NEUTRAL)
        look = {"facecolor": colour, "edgecolor": colour, "alpha": 0.45, "linewidth": 0.6, "zorder": 2}
    elif cat in ("forward", "backward"):
        family = FORWARD if cat == "forward" else BACKWARD
        look = {"facecolor": family[shades.get(name_of(event), 0) % len(family)], "edgecolor": "white", "zorder": 2}
    else:
        look = {"facecolor": COMPUTE.get(cat, NEUTRAL), "edgecolor": "white", "zorder": 2}
    look.setdefault("linewidth", 0.4)
    return cat, tuple(sorted(look.items()))


def _span_ms(lines: list[tuple[int, dict[str, Any]]]) -> float:
    ends = [e["start"] + e["dur"] for _, t in lines for e in t.get("events", ())]
    return max([*ends, 1e-6]) * 1e3


def _draw_rank(
    axes: Any, rows: dict[str, float], timeline: dict[str, Any], shades: dict[str, int], looks: dict
) -> None:
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for event in timeline.get("events", ()):
        label, look = style(event, shades)
        looks.setdefault(label, look)
        row = "comm" if lane_of(event) == "comm" else "compute"
        groups[(row, look)].append((event["start"] * 1e3, event["dur"] * 1e3))
    for (row, look), spans in groups.items():
        height = 0.8 if row == "compute" else 0.6
        axes.broken_barh(spans, (rows[row] - height / 2, height), **dict(look))


def _label_units(axes: Any, y: float, timeline: dict[str, Any], ms_per_char: float) -> None:
    for event in timeline.get("events", ()):
        if lane_of(event) == "compute" and event.get("cat") in LABELLED:
            name, width = name_of(event), event["dur"] * 1e3
            if width >= (len(name) + 1) * ms_per_char:
                middle = (event["start"] + event["dur"] / 2) * 1e3
                axes.text(middle, y, name, ha="center", va="center", fontsize=6, color="white", clip_on=True, zorder=4)


def _title(lines: list[tuple[int, dict[str, Any]]], predicted: dict[str, Any] | None = None) -> str:
    """Which optimizer step is drawn (budget/measured/step_time.py numbers it), each rank's time in it, and the
    step predicted."""
    steps = sorted({int(t["step"]) for _, t in lines if t.get("step") is not None})
    times = [f"rank {r} {float(t.get('step_seconds', 0.0)) * 1e3:.2f} ms" for r, t in lines]
    times += [f"predicted {float(predicted.get('step_seconds', 0.0)) * 1e3:.2f} ms"] if predicted else []
    rows = [", ".join(times[i : i + 6]) for i in range(0, len(times), 6)]
    which = f" (optimizer step {'/'.join(map(str, steps))})" if steps else ""
    return f"one steady step{which}: " + ",\n".join(rows)


def _legend(axes: Any, looks: dict[str, tuple]) -> None:
    from matplotlib.patches import Patch

    names = {"comm_exposed": "exposed comm wait", "waiting_for_ranks": "waiting for other ranks"}
    order = [c for c in LEGEND if c in looks] + sorted(c for c in looks if c not in LEGEND)
    keep = ("facecolor", "edgecolor", "hatch", "alpha")
    handles = [
        Patch(label=names.get(c, c.replace("_", "-")), **{k: v for k, v in looks[c] if k in keep}) for c in order
    ]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")


def write_timeline_png(reports: list[dict[str, Any]], path: Path) -> Path | None:
    """Draw every rank's step into ``path`` (PNG, or ``path/shardlab_timeline.png``), and rank 0's predicted step
    below them; None when matplotlib is not installed or no report has a timeline."""
    lines = timelines(reports)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    if not lines:
        return None
    predicted = predicted_timeline(reports)
    lanes = [(f"rank {rank}", timeline) for rank, timeline in lines] + ([("predicted", predicted)] if predicted else [])
    width, count = 13.0, len(lanes)
    figure = Figure(figsize=(width, 1.6 + 0.95 * count))
    axes = figure.add_subplot()
    drawn = [(i, t) for i, (_, t) in enumerate(lanes)]
    span, shades, looks = _span_ms(drawn), unit_shades(drawn), {}
    ms_per_char = 0.055 * span / (0.7 * width)  # fontsize 6: about 0.055 inch a character; the axes ~70% wide
    ticks, names = [], []
    for place, (label, timeline) in enumerate(lanes):
        base = 2.2 * (count - 1 - place)  # rank 0 on top
        rows = {"compute": base + 1.0, "comm": base}
        _draw_rank(axes, rows, timeline, shades, looks)
        _label_units(axes, rows["compute"], timeline, ms_per_char)
        ticks += [rows["compute"], rows["comm"]]
        names += [f"{label}  compute", "comm"]
        if place:
            axes.axhline(base + 1.7, color="#cccccc", linewidth=0.8)
    axes.set_yticks(ticks, names, fontsize="small")
    axes.set_xlim(0, span * 1.01)
    axes.set_ylim(-0.7, 2.2 * (count - 1) + 1.7)
    axes.set_xlabel("ms (one clock for all ranks)")
    axes.grid(axis="x", color="#eeeeee", zorder=0)
    axes.set_title(_title(lines, predicted), fontsize="medium")
    _legend(axes, looks)
    figure.tight_layout()
    target = _target(path, PNG_NAME)
    figure.savefig(target, dpi=110)
    return target
