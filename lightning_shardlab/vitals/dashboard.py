"""The per-rank dashboard: every rank's vital signs overlaid, outliers marked, as PNG and HTML.

A distributed failure rarely shows on rank 0's curves alone: one rank's loss spikes, its activations
blow up, or its shard stops moving while the others look fine. Overlaying the ranks makes the odd one
stand out, and ``find_outliers`` marks it:

    for each signal and step, the centre is the median over ranks and a rank's deviation its distance
    from it (signals that are positive by nature -- spreads, norms, ratios -- are compared in log10);
    the scale is the median deviation over the whole run (how far apart healthy ranks usually are),
    floored at 5 % of the centre (linear) or 0.1 decades (log); a value more than ``z`` scales from the
    centre, or not finite where the centre is, is an outlier.

With two ranks both deviate equally from their median, so an outlier marks the pair; three or more
ranks name the odd one. Signals that are the same on every rank by construction (the averaged
gradient's norm, update ratios) are drawn once, in black, and never compared; a panel without data
says why (a frozen unit, a module whose own forward never runs). Where a fewer-bytes option is on, one more
run-wide panel draws the error it brings per unit (vitals/option_curves.py): global signs too, never compared.
"""

from __future__ import annotations

import base64
import html
import json
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GLOBAL = "grad_norm"  # the norm of the averaged gradient: the same on every rank
LINEAR = ("loss", "act_mean")  # signals that may be negative; the rest are compared in log10
# where each rank's time goes: drawn, never outliers (a shared machine's timings are noisy step by step; the budget
# names a rank that is slow over windows of steps: budget/measured/stragglers.py)
TIMING = (("step_seconds", "step time, s"), ("comm_blocked_seconds", "blocked on collectives, s"))
OPTION_ERROR = "option_error/"  # the fewer-bytes options' error per unit: one panel, a curve per option and unit


@dataclass
class VitalsHistory:
    steps: list[int]
    signals: list[str]  # e.g. "loss", "grad_norm_local", "act_std/blocks.0", "update_ratio/blocks.0"
    values: np.ndarray  # (steps, world, signals), NaN where a rank had no value
    title: str = "shardlab vital signs"
    global_signals: list[str] = field(default_factory=lambda: [GLOBAL])  # the same on every rank: drawn once
    reasons: dict[str, str] = field(default_factory=dict)  # signal -> why it has no data (shown in its panel)

    @property
    def world_size(self) -> int:
        return self.values.shape[1]

    def series(self, signal: str) -> np.ndarray:
        """(steps, world)"""
        return self.values[:, :, self.signals.index(signal)]

    def units(self) -> list[str]:
        return [s.split("/", 1)[1] for s in self.signals if s.startswith("act_std/")]


@dataclass
class Outlier:
    signal: str
    rank: int
    step: int
    value: float
    median: float  # of all ranks at that step


def _kind(signal: str) -> str:
    return signal.split("/", 1)[0]


def _comparable(signal: str, raw: np.ndarray) -> np.ndarray:
    """What deviations are measured on: the value, or log10 of it for positive-by-nature signals."""
    if _kind(signal) in LINEAR:
        return raw
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log10(np.where(raw > 0, raw, np.nan))


def _missing_ok(signal: str) -> bool:
    """NaN means 'no value' only for gradient norms (a frozen unit, or a step without an optimizer step);
    elsewhere it is a fault."""
    return _kind(signal) in ("grad_norm_local", "update_ratio")


@contextmanager
def _quiet() -> Iterator[None]:
    """numpy warns on all-NaN slices; here they only mean 'no value at that step'."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def find_outliers(history: VitalsHistory, z: float = 6.0) -> list[Outlier]:
    out = []
    for signal in history.signals:
        if signal in history.global_signals or signal in dict(TIMING) or history.world_size < 2:
            continue
        raw = history.series(signal)  # (steps, world)
        x = _comparable(signal, raw)
        with _quiet():
            center = np.nanmedian(x, axis=1, keepdims=True)  # (steps, 1)
            dev = np.abs(x - center)  # (steps, world)
            scale = float(np.nanmedian(dev)) if np.isfinite(dev).any() else 0.0
            floor = 0.05 * float(np.nanmedian(np.abs(center))) if _kind(signal) in LINEAR else 0.1
        limit = z * max(scale, floor if np.isfinite(floor) else 0.0, 1e-12)
        broken = np.isinf(raw) | (np.isnan(raw) & ~_missing_ok(signal))
        bad = (np.isfinite(dev) & (dev > limit)) | (broken & np.isfinite(center))
        for t, r in zip(*np.nonzero(bad)):
            with _quiet():
                median = float(np.nanmedian(raw[t]))
            out.append(Outlier(signal, int(r), int(history.steps[t]), float(raw[t, r]), median))
    return out


# ---- rendering ----


UNIT_SIGNALS = (
    ("act_std", "activation std"),
    ("act_absmax", "activation max |x|"),
    ("grad_norm_local", "gradient norm,\nthis rank's own"),
    ("update_ratio", "update ratio |Δw|/|w|\n(all ranks)"),
)


def panel_grid(n_units: int, extra: int = 0) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Rows, columns and each panel's (row, first column, columns spanned), in drawing order: the run-wide panels
    (the loss, the gradient norm, the step time, the time blocked on collectives, and ``extra`` ones: the options'
    error), then each unit signal for each unit. The top row is split between the run-wide panels. Several units:
    then a row per signal, a column per unit. One unit: its panels in one row. The columns are a multiple of every
    row's panels, so each row's panels are as wide as each other; no cell is left empty."""
    run_wide = 2 + len(TIMING) + extra
    if n_units <= 1:
        rows = [(0, run_wide)] + ([(1, len(UNIT_SIGNALS))] if n_units else [])
    else:
        rows = [(0, run_wide)] + [(i, n_units) for i in range(1, 1 + len(UNIT_SIGNALS))]
    cols = math.lcm(*(n for _, n in rows))
    return len(rows), cols, [cell for row, n in rows for cell in _split(row, n, cols)]


def _split(row: int, n: int, cols: int) -> list[tuple[int, int, int]]:
    """``n`` panels side by side across ``cols`` columns of ``row``."""
    edges = [round(i * cols / n) for i in range(n + 1)]
    return [(row, a, b - a) for a, b in zip(edges, edges[1:])]


def render_png(history: VitalsHistory, outliers: list[Outlier], path: Path, max_units: int = 8) -> Figure:
    """The dashboard's figure, saved to ``path``; returned for a look at its layout."""
    from matplotlib import colormaps  # no pyplot: nothing global changes in the user's process
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    units = _pick(history.units(), max_units)
    options = [s for s in history.signals if s.startswith(OPTION_ERROR)]
    rows, cols, cells = panel_grid(len(units), 1 if options else 0)
    widest = max(sum(1 for cell in cells if cell[0] == row) for row in range(rows))  # panels in the fullest row
    fig = Figure(figsize=(3.4 * widest, 2.6 * rows + 0.8), layout="constrained")
    # a grid per row: the layout sets each row's margins by its own panels (rows split differently do not share edges)
    grid = [row.subgridspec(1, cols) for row in fig.add_gridspec(rows, 1)]
    axes = [fig.add_subplot(grid[r][0, c : c + span]) for r, c, span in cells]
    colors = colormaps["tab10"]
    marks = {(o.signal, o.rank, o.step) for o in outliers}
    _panel(axes[0], history, "loss", "loss", colors, marks, log=False)
    title = "gradient norm: each rank's own,\naveraged (black)"
    _panel(axes[1], history, "grad_norm_local", title, colors, marks, log=True)
    if GLOBAL in history.signals:
        axes[1].plot(
            history.steps, history.series(GLOBAL)[:, 0], color="black", linestyle="--", linewidth=1.2, label="global"
        )
    for ax, (signal, title) in zip(axes[2:], TIMING):
        _panel(ax, history, signal, title, colors, marks, log=False)
    if options:
        _options_panel(axes[2 + len(TIMING)], history, options, colors)
    panels = [(f"{prefix}/{unit}", f"{title} ({unit})") for prefix, title in UNIT_SIGNALS for unit in units]
    for ax, (signal, title) in zip(axes[2 + len(TIMING) + bool(options) :], panels):
        _panel(ax, history, signal, title, colors, marks, log=True)
    handles = [Line2D([], [], color=colors(r % 10), label=f"rank {r}") for r in range(history.world_size)]
    handles.append(Line2D([], [], color="black", label="the same on every rank"))
    handles.append(Line2D([], [], color="red", marker="x", linestyle="", label="outlier"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 9))
    fig.suptitle(history.title)
    fig.savefig(path, dpi=90)
    return fig


def _pick(units: list[str], n: int) -> list[str]:
    if len(units) <= n:
        return units
    idx = np.linspace(0, len(units) - 1, n).round().astype(int)
    return [units[i] for i in sorted(set(idx))]


def _panel(ax, history: VitalsHistory, signal: str, title: str, colors, marks: set, log: bool):  # noqa: ANN001, ANN202
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=7)
    series = history.series(signal) if signal in history.signals else None
    if series is None or np.isnan(series).all():
        why = history.reasons.get(signal, "no data")
        ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=7, color="gray", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax
    ranks = [0] if signal in history.global_signals else range(history.world_size)
    for r in ranks:
        color = "black" if signal in history.global_signals else colors(r % 10)
        ax.plot(history.steps, series[:, r], color=color, linewidth=1.0, alpha=0.85)
        bad = [(s, v) for s, v in zip(history.steps, series[:, r]) if (signal, r, s) in marks and np.isfinite(v)]
        if bad:
            ax.scatter(*zip(*bad), color="red", marker="x", s=28, zorder=3)
    if log and np.nanmin(np.where(series > 0, series, np.nan), initial=np.inf) < np.inf:
        ax.set_yscale("log")
    return ax


def _options_panel(ax, history: VitalsHistory, signals: list[str], colors):  # noqa: ANN001, ANN202
    """The fewer-bytes options' relative error per unit, all ranks' together: a colour per unit, solid for the int8
    gathers, dashed for the packed reductions; without data, why."""
    ax.set_title("fewer-bytes options: relative error\n(solid: int8 gathers, dashed: reductions)", fontsize=8)
    ax.tick_params(labelsize=7)
    drawn = [s for s in signals if not np.isnan(history.series(s)[:, 0]).all()]
    if not drawn:
        why = history.reasons.get(signals[0], "no data")
        ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=7, color="gray", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax
    from matplotlib.lines import Line2D

    units = list(dict.fromkeys(s.split("/", 2)[2] for s in signals))
    for signal in drawn:
        _, option, unit = signal.split("/", 2)
        style = "-" if option == "gather" else "--"
        ax.plot(history.steps, history.series(signal)[:, 0], color=colors(units.index(unit) % 10), linestyle=style,
                linewidth=1.0)  # fmt: skip
    if np.nanmin(np.stack([history.series(s)[:, 0] for s in drawn])) > 0:
        ax.set_yscale("log")
    if len(units) <= 6:  # a colour per unit
        ax.legend(handles=[Line2D([], [], color=colors(i % 10), label=u) for i, u in enumerate(units)], fontsize=6)
    return ax


def render_html(history: VitalsHistory, outliers: list[Outlier], png: Path, path: Path) -> None:
    image = base64.b64encode(png.read_bytes()).decode()
    rows = "".join(
        f"<tr><td>{html.escape(o.signal)}</td><td>{o.rank}</td><td>{o.step}</td><td>{o.value:.6g}</td>"
        f"<td>{o.median:.6g}</td></tr>"
        for o in outliers[:500]
    )
    last = history.values[-1] if len(history.steps) else np.empty((history.world_size, 0))
    summary = "".join(
        f"<tr><td>{html.escape(s)}</td>"
        + "".join(f"<td>{_fmt(last[r, k])}</td>" for r in range(history.world_size))
        + "</tr>"
        for k, s in enumerate(history.signals)
    )
    per_rank = {r: sum(o.rank == r for o in outliers) for r in range(history.world_size)}
    rank_heads = "".join(f"<th>rank {r}</th>" for r in range(history.world_size))
    path.write_text(f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(history.title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}</style></head><body>
<h1>{html.escape(history.title)}</h1>
<p>{history.world_size} ranks, {len(history.steps)} logged steps. Outliers per rank: {per_rank}
(a value more than z robust scales from the median of the ranks at that step, or not finite).</p>
<img src="data:image/png;base64,{image}" style="max-width:100%">
<h2>Outliers ({len(outliers)})</h2><table><tr><th>signal</th><th>rank</th><th>step</th><th>value</th>
<th>median of ranks</th></tr>{rows}</table>
<h2>Last logged step, per rank</h2><table><tr><th>signal</th>{rank_heads}</tr>{summary}</table>
</body></html>
""")


def _fmt(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.4g}"


def write_dashboard(history: VitalsHistory, directory: Path, z: float = 6.0) -> dict[str, Path]:
    """vitals.png, vitals.html (the PNG embedded, the outliers listed) and vitals.json (the numbers)."""
    directory.mkdir(parents=True, exist_ok=True)
    outliers = find_outliers(history, z)
    paths = {kind: directory / f"vitals.{kind}" for kind in ("png", "html", "json")}
    render_png(history, outliers, paths["png"])
    render_html(history, outliers, paths["png"], paths["html"])
    paths["json"].write_text(
        json.dumps(
            {
                "steps": history.steps,
                "signals": history.signals,
                "global_signals": history.global_signals,
                "reasons": history.reasons,
                "values": [
                    [[None if math.isnan(v) else v for v in rank] for rank in step] for step in history.values.tolist()
                ],
                "outliers": [asdict(o) for o in outliers],
            }
        )
    )
    return paths
