"""The README's and the manual's snippets: every ```python and ```bash block in README.md and docs/*.md is marked,
on the line before it, ``<!-- run -->`` or ``<!-- not run: <why> -->``, and the ones marked ``run`` run here.

A bash block that runs holds ``shardlab`` commands only (run in this process, through ``cli.main``: no interpreter
start per command), and every figure its comments quote (``17.50 GB``, ``18.3 ms``) must be in what the command
prints, so a number in the prose cannot drift from the tool. A python block that runs is executed on its own, in a
fresh namespace, in a temporary folder. The blocks that are not run (a fit on several ranks, minutes of work, a
GPU, a fragment that needs your model) each say why; ``pytest tests/test_docs.py -rs`` lists them as skips with
that reason. The site itself is checked by ``mkdocs build --strict`` in scripts/test.sh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest

from lightning_shardlab import cli

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash")
MARKER = re.compile(r"^<!-- (run|not run: (?P<why>.+\S)) -->$")
FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)? ?(?:TB|GB|MB|KB|GiB|MiB|ms)\b")


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One fenced block of a page: where it is, its language, its marker line (or None) and its code."""

    path: Path
    line: int
    language: str
    marker: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """The ```python and ```bash blocks of ``path``, each with the non-blank line before it (its marker)."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if opening.group(1) in LANGUAGES:
            marker = before if before.startswith("<!-- ") else None
            found.append(Snippet(path, i + 1, opening.group(1), marker, "\n".join(lines[i + 1 : end])))
        i = end + 1
    return found


ALL = [s for path in SOURCES for s in snippets(path)]


def commands(code: str) -> list[tuple[str, str]]:
    """A bash block as (command, the comments that follow it: on its lines and on the comment lines after it)."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    found: list[list[str]] = []
    for line in joined.split("\n"):
        if not line.strip():
            continue
        command, _, comment = line.partition(" #") if not line.lstrip().startswith("#") else ("", "", line)
        if command.strip():
            found.append([command.strip(), comment])
        elif found:
            found[-1][1] += " " + comment
    return [(command, comment) for command, comment in found]


def run_shardlab(command: str) -> str:
    """``command`` (``shardlab ...``) run in this process; what it printed."""
    argv = shlex.split(command)
    assert argv[0] == "shardlab", f"a bash snippet marked run holds shardlab commands only, not {command!r}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(argv[1:])
    assert code in (None, 0), f"{command!r} exited {code}:\n{printed.getvalue()}"
    return printed.getvalue()


def test_every_snippet_is_marked_run_or_not_run_with_its_reason() -> None:
    assert len(ALL) >= 20, [s.where for s in ALL]  # the pages are read: README and manual hold dozens
    unmarked = [s.where for s in ALL if s.marker is None or not MARKER.match(s.marker)]
    assert unmarked == [], (
        f"snippets without a marker: {unmarked}. HINT: put '<!-- run -->' on the line before a ```python or ```bash "
        "block that runs in seconds on one process, or '<!-- not run: <why> -->' (several ranks, minutes, a GPU, "
        "your own model)."
    )
    assert sum(s.marker == "<!-- run -->" for s in ALL) >= 5


def test_commands_and_their_comments_are_read_as_written() -> None:
    """The reader the runner relies on: continuation lines joined, a comment kept with its command, a comment
    line after a command added to it; and a figure the output lacks is what the runner reports."""
    block = "shardlab plan --params 7e9 \\\n   --stage 3  # 1.75 GB per rank\n# 112.00 GB unsharded\nshardlab x"
    assert commands(block) == [
        ("shardlab plan --params 7e9 --stage 3", " 1.75 GB per rank # 112.00 GB unsharded"),
        ("shardlab x", ""),
    ]
    assert FIGURE.findall("step 9.2 ms, 140 GB per rank, 1,225.9 ms, 3 ranks") == ["9.2 ms", "140 GB", "1,225.9 ms"]


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub and the manual's toc make them (lower case, words and hyphens)."""
    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", h.lower()).strip()) for h in headings}


def test_readme_links_reach_a_file_and_its_heading() -> None:
    """The README is not part of the site, so mkdocs does not check it: its relative links and pictures must name a
    file of the repository, and an anchor a heading of that file (or of the README itself)."""
    readme = ROOT / "README.md"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        page = (ROOT / path) if path else readme
        if not page.is_file() or (anchor and page.suffix == ".md" and anchor not in anchors(page)):
            broken.append(target)
    assert broken == [], f"README.md links to what is not there: {broken}"


INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::(\w+))?"$', re.M)


def test_a_rewritten_results_section_keeps_the_markers_the_manual_includes(tmp_path: Path) -> None:
    """A benchmark rewriting its section of RESULTS.md (its text without snippet markers) leaves the section in place
    for the pages that include it, and bench.py's rewrite of the rest keeps it whole."""
    from benchmarks.sections import MARKERS, kept_sections, replace_section, snippet_markers

    results = tmp_path / "RESULTS.md"
    results.write_text((ROOT / "benchmarks" / "RESULTS.md").read_text())
    begin, end = MARKERS["time_cost"]
    replace_section(results, "time_cost", f"{begin}\n## What measuring time costs\n\nrewritten\n{end}")
    start, stop = snippet_markers("time_cost")
    text = results.read_text()
    assert text.count(start) == 1 and text.count(stop) == 1
    assert "rewritten" in text[text.index(start) : text.index(stop)]
    assert all(name in kept_sections(results) for name in snippet_markers("hook_reads"))


def test_every_include_of_a_page_names_a_file_and_its_section() -> None:
    """The pages take benchmark figures from the files by include (``--8<-- "benchmarks/RESULTS.md:name"``); each
    names a file of the repository and, where it names a section, one marked in that file (mkdocs fails on a missing
    one too, but only in scripts/test.sh)."""
    found = [m.groups() for page in SOURCES[1:] for m in INCLUDE.finditer(page.read_text())]
    assert len(found) >= 15, found
    missing = [
        (path, name)
        for path, name in found
        if not (ROOT / path).is_file() or (name and f"[start:{name}]" not in (ROOT / path).read_text())
    ]
    assert missing == [], f"includes of what is not there: {missing}"


@pytest.mark.parametrize("snippet", ALL, ids=[s.where for s in ALL])
def test_snippet_runs(snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = MARKER.match(snippet.marker or "")
    if found is None:
        pytest.fail(f"{snippet.where}: not marked (test_every_snippet_is_marked_run_or_not_run_with_its_reason)")
    if found.group("why"):
        pytest.skip(f"{snippet.where}: not run: {found.group('why')}")
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes (lightning_logs/) lands here
    if snippet.language == "python":
        exec(compile(snippet.code, snippet.where, "exec"), {"__name__": "__snippet__"})
        return
    for command, comment in commands(snippet.code):
        printed = run_shardlab(command)
        missing = [f for f in FIGURE.findall(comment) if f not in printed]
        assert missing == [], f"{snippet.where}: {command!r} does not print {missing}, which its comment quotes"
