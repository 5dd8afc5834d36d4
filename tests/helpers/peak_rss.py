"""How much a piece of code raises a fresh process's peak resident memory, from that process's ``ru_maxrss``.

A process started by a large one would report the parent's peak: Linux carries a process's high-water
mark into ``ru_maxrss`` across ``exec``, and ``subprocess`` starts a child with vfork, which runs in the
parent's memory until it execs. So the code runs in a grandchild started by a small Python launcher,
whose own memory is all the grandchild inherits, and reports ``ru_maxrss`` after its imports and after
the code: the difference is what the code added to the peak.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import ROOT

_LAUNCHER = (
    "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]], cwd=sys.argv[2]).returncode)"
)
_REPORT = "PEAK_RSS "


def peak_rss_growth(setup: str, code: str, timeout: float = 300.0) -> int:
    """Bytes by which ``code`` raised the peak resident memory of a fresh process that first ran ``setup``
    (imports: not counted)."""
    child = "\n".join(
        [
            "import json, resource",
            setup,
            "_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss",
            code,
            "_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss",
            f"print({_REPORT!r} + json.dumps([_before, _after]))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, child, str(ROOT)], capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(_REPORT)]
    assert done.returncode == 0 and lines, f"the measured process failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    before, after = json.loads(lines[-1].removeprefix(_REPORT))
    return (after - before) * 1024  # ru_maxrss is in KiB on Linux
