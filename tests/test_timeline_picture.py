"""The budget's time side as a picture: the Chrome trace and the PNG of one steady step, from synthetic reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_shardlab.budget.timeline_picture import threads, write_chrome_trace, write_timeline_png

UNITS = ("embed", "blocks.0", "blocks.1", "head")


def _timeline(rank: int, step: int = 7) -> dict[str, Any]:
    """One rank's steady step: data, forward and backward by unit with their collectives beside, a blocked wait or
    two, the optimizer; rank r starts 0.1 ms * r later than rank 0 (so rank 0 waits for the others)."""
    t, shift, events = 0.0, 1e-4 * rank, []

    def add(name: str, cat: str, dur: float, lane: str = "compute", at: float | None = None) -> None:
        nonlocal t
        start = t if at is None else at
        events.append({"name": name, "cat": cat, "lane": lane, "start": shift + start, "dur": dur})
        if lane == "comm":
            events[-1]["bytes"] = 4096  # what else an event holds rides along in the trace's args
        if lane == "compute":
            t = start + dur

    add("data", "data", 3e-4)
    for i, unit in enumerate(UNITS):
        add(f"all_gather {unit}", "all_gather", 2e-4, "comm", at=t)
        if i == 1:
            add(f"all_gather {unit}", "comm_exposed", 2e-4)
        add(unit, "forward", 6e-4 + 1e-4 * i)
    for unit in reversed(UNITS):
        add(unit, "backward", 1.2e-3)
        add(f"reduce_scatter {unit}", "reduce_scatter", 4e-4, "comm", at=t)
    if rank == 0:
        add("reduce_scatter embed", "waiting_for_ranks", 2e-4)
    add("all_reduce grad_norm", "all_reduce", 5e-5, "comm", at=t + 4e-4)  # after the last reduce-scatter
    add("optimizer", "optimizer", 8e-4)
    add("mystery", "something_new", 1e-4)  # a cat this module does not know yet
    events.sort(key=lambda e: e["start"])
    return {"step": step, "step_seconds": t, "events": events}


def _reports(world: int, without: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    return [{"rank": r, **({} if r in without else {"timeline": _timeline(r)})} for r in range(world)]


def _trace(reports: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    path = write_chrome_trace(reports, tmp_path / "shardlab_timeline.trace.json")
    assert path == tmp_path / "shardlab_timeline.trace.json"
    return json.loads(path.read_text())


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_the_trace_holds_every_event_in_microseconds_one_process_per_rank(world: int, tmp_path: Path) -> None:
    reports = _reports(world)
    trace = _trace(reports, tmp_path)
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = [e for e in meta if e["name"] == "process_name"]
    assert sorted(e["pid"] for e in processes) == list(range(world))
    assert {e["pid"]: e["args"]["name"] for e in processes} == {r: f"rank {r}" for r in range(world)}
    for report in reports:
        rank, given = report["rank"], report["timeline"]["events"]
        mine = [e for e in complete if e["pid"] == rank]
        assert len(mine) == len(given)
        for source, event in zip(given, mine):  # in start order, as given
            assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(event)
            assert (event["name"], event["cat"]) == (source["name"], source["cat"])
            assert event["ts"] == source["start"] * 1e6 and event["dur"] == source["dur"] * 1e6
            assert event["tid"] == (1 if source["lane"] == "comm" else 0)
            assert event["args"]["lane"] == source["lane"]
            assert event["args"].get("bytes") == source.get("bytes")
        names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name" and e["pid"] == rank}
        assert names == {0: "compute", 1: "comm"}


def test_a_rank_without_a_timeline_is_left_out_and_none_at_all_is_an_empty_trace(tmp_path: Path) -> None:
    trace = _trace(_reports(3, without=(1,)), tmp_path)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 2}
    assert len([e for e in trace["traceEvents"] if e["name"] == "process_name"]) == 2
    assert _trace(_reports(2, without=(0, 1)), tmp_path)["traceEvents"] == []
    assert write_timeline_png(_reports(2, without=(0, 1)), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_collectives_in_flight_together_get_a_thread_each_and_nested_waits_stay_on_compute() -> None:
    """Complete events on one thread must nest (the trace format; Perfetto breaks them otherwise): a second
    collective launched before the first completes goes to "comm 2", a wait inside a unit's forward stays on tid 0."""
    events = [
        {"name": "blocks.0", "cat": "forward", "lane": "compute", "start": 0.0, "dur": 1.0},
        {"name": "all_gather blocks.0", "cat": "comm_exposed", "lane": "compute", "start": 0.1, "dur": 0.2},
        {"name": "all_gather blocks.1", "cat": "all_gather", "lane": "comm", "start": 0.2, "dur": 0.5},
        {"name": "all_gather blocks.2", "cat": "all_gather", "lane": "comm", "start": 0.4, "dur": 0.5},
        {"name": "reduce_scatter blocks.0", "cat": "reduce_scatter", "lane": "comm", "start": 0.8, "dur": 0.1},
    ]
    tids, lanes = threads(events)
    assert tids == [0, 0, 1, 2, 1]
    assert lanes == {"compute": [0], "comm": [1, 2]}


def test_the_png_is_drawn_for_every_rank_with_a_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the picture needs matplotlib (the plot extra); the trace does not")
    for world in (2, 3):
        path = write_timeline_png(_reports(world, without=(1,) if world == 3 else ()), tmp_path / f"{world}.png")
        assert path == tmp_path / f"{world}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_timeline_png(_reports(2), tmp_path) == tmp_path / "shardlab_timeline.png"  # a folder: the default name


@pytest.mark.quick
def test_the_title_names_the_optimizer_step_drawn() -> None:
    """The step's number comes with the timeline (budget/measured/step_time.py numbers it from the warm-up); one that
    has none says so in words, never "step ?"."""
    from lightning_shardlab.budget.timeline_picture import _title

    reports = _reports(2)
    title = _title([(r["rank"], r["timeline"]) for r in reports])
    assert title.startswith("one steady step (optimizer step 7): rank 0 ") and "rank 1 " in title, title
    unnumbered = [(0, {k: v for k, v in _timeline(0).items() if k != "step"})]
    assert _title(unnumbered).startswith("one steady step: rank 0 "), _title(unnumbered)


def test_rank_0s_predicted_step_is_drawn_below_the_ranks_from_the_time_model(tmp_path: Path) -> None:
    """The prediction's own played step (budget/predicted/step_time.py's ``timeline``) is a process of the trace after
    the ranks, and a lane of the picture named in its title; without measured ranks there is still nothing."""
    from lightning_shardlab.budget.timeline_picture import _title, predicted_timeline
    from tests.test_time_predicted import setting

    played = setting(stage=3).predict()["timeline"]
    reports = _reports(2)
    reports[0]["time_predicted"] = {"timeline": played}
    assert predicted_timeline(reports) is played
    trace = _trace(reports, tmp_path)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1", 2: "predicted"}
    predicted = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert len(predicted) == len(played["events"]) and trace["otherData"]["predicted"]["step_seconds"] > 0
    title = _title([(r["rank"], r["timeline"]) for r in reports], played)
    assert f"predicted {played['step_seconds'] * 1e3:.2f} ms" in title
    if importlib.util.find_spec("matplotlib"):
        assert write_timeline_png(reports, tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    alone = [{"rank": 0, "time_predicted": {"timeline": played}}]
    assert _trace(alone, tmp_path)["traceEvents"] == [] and write_timeline_png(alone, tmp_path / "q.png") is None
