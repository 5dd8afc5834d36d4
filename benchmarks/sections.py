"""RESULTS.md is written by several benchmarks: bench.py owns the file, the others each own a marked section.

Each section also carries the manual's snippet markers (``<!-- --8<-- [start:name] -->`` ... ``[end:name]``), inside
its begin/end markers, so a page of docs/ includes the section as the benchmark wrote it
(``--8<-- "benchmarks/RESULTS.md:name"``) instead of copying its figures: a rewrite must keep them, or the manual's
build fails on the missing section.
"""

from __future__ import annotations

from pathlib import Path

# (begin, end) of every section a benchmark other than bench.py writes
MARKERS = {
    "defaults_cost": ("<!-- defaults_cost: begin -->", "<!-- defaults_cost: end -->"),
    "identity_cost": ("<!-- identity_cost: begin -->", "<!-- identity_cost: end -->"),
    "whole_tensor": ("<!-- whole_tensor: begin -->", "<!-- whole_tensor: end -->"),
    "activations_cost": ("<!-- activations_cost: begin -->", "<!-- activations_cost: end -->"),
    "time_cost": ("<!-- time_cost: begin -->", "<!-- time_cost: end -->"),
    "stage_3_time": ("<!-- stage_3_time: begin -->", "<!-- stage_3_time: end -->"),
    "step_profile": ("<!-- step_profile: begin -->", "<!-- step_profile: end -->"),
    "hook_reads": ("<!-- hook_reads: begin -->", "<!-- hook_reads: end -->"),
}


def snippet_markers(name: str) -> tuple[str, str]:
    """The manual's (pymdownx.snippets) start and end markers of section ``name``: HTML comments, unseen on GitHub."""
    return f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"


def with_snippet_markers(name: str, text: str) -> str:
    """``text`` (a section between its begin/end markers) with the snippet markers just inside them, once."""
    begin, end = MARKERS[name]
    start, stop = snippet_markers(name)
    if start not in text:
        text = text.replace(begin, f"{begin}\n{start}", 1)
    if stop not in text:
        text = text.replace(end, f"{stop}\n{end}", 1)
    return text


def replace_section(path: Path, name: str, text: str) -> None:
    """Replace section ``name`` of ``path`` with ``text`` (which carries the markers), or append it."""
    begin, end = MARKERS[name]
    text = with_snippet_markers(name, text)
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        old = old[: old.index(begin)].rstrip() + old[old.index(end) + len(end) :]
    path.write_text(old.rstrip() + "\n\n" + text + "\n")


def kept_sections(path: Path) -> str:
    """Every marked section of ``path``, for bench.py to keep when it rewrites the rest."""
    text = path.read_text() if path.exists() else ""
    kept = [text[text.index(b) : text.index(e) + len(e)] for b, e in MARKERS.values() if b in text and e in text]
    return "".join("\n" + k + "\n" for k in kept)
