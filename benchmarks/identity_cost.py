"""What one identity per parameter costs: the 14M GPT's step at stages 1-3, before and after, in one run.

    python -m benchmarks.identity_cost --before 476413b          # the commit before one identity
    python -m benchmarks.identity_cost --before 476413b --quick  # 1 repeat, printed, RESULTS.md untouched

"Before" is the package as it was at ``--before`` (``git archive`` into a temporary directory); "after" is this
checkout. Each repeat runs, for each stage, both versions back to back in fresh processes (benchmarks/bench.py's
``sample``: 2 CPU ranks, 1 thread each, gloo, fp32 AdamW, the median of the timed steps after warm-up), so
both meet the same machine load. Reported: the median step of each, and after / before per repeat (median,
min-max). The section goes into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.sections import MARKERS, replace_section

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def checkout(ref: str, into: Path) -> Path:
    """The tree of ``ref`` (package and benchmarks) in ``into``."""
    archive = into / "before.tar"
    subprocess.run(["git", "archive", "-o", str(archive), ref], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "before", filter="data")
    return into / "before"


def one_sample(tree: Path, stage: int, warmup: int, steps: int) -> float:
    """Seconds per step of ``shardlab_stage_<stage>`` with the package of ``tree`` (run from there, so its
    ``lightning_shardlab`` is the one imported)."""
    code = (
        "import json; from benchmarks.bench import sample;"
        f" print('RESULT', json.dumps(sample('shardlab_stage_{stage}', 'default', {warmup}, {steps})))"
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["seconds"]


def section(times: dict, args: argparse.Namespace, minutes: float) -> str:
    begin, end = MARKERS["identity_cost"]
    lines = [
        begin,
        "## What one identity per parameter costs\n",
        f"Command: `python -m benchmarks.identity_cost --before {args.before} --repeats {args.repeats}`"
        f" ({minutes:.1f} min). The default setting's GPT (13,816,704 parameters), 2 ranks, fp32 AdamW; each"
        " repeat runs both versions of each stage back to back. Before: the package at"
        f" `{args.before}` (the module holds placeholders at rest, the optimizer master views); after: this"
        " checkout (one parameter object for the whole run, its data swapped).\n",
        "| stage | before, s/step | after, s/step | after / before, median | min-max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage in args.stages:
        before, after = times[stage]["before"], times[stage]["after"]
        ratios = [a / b for a, b in zip(after, before)]
        lines.append(
            f"| {stage} | {statistics.median(before):.4f} | {statistics.median(after):.4f} |"
            f" {statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |"
        )
    lines.append(end)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git commit to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2, 3])
    parser.add_argument("--quick", action="store_true", help="1 repeat, print only")
    args = parser.parse_args()
    args.repeats = 1 if args.quick else args.repeats
    start = time.monotonic()
    times = {stage: {"before": [], "after": []} for stage in args.stages}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": checkout(args.before, Path(tmp)), "after": ROOT}
        for repeat in range(args.repeats):
            for stage in args.stages:
                for name, tree in trees.items():
                    times[stage][name].append(one_sample(tree, stage, args.warmup, args.steps))
                    print(f"repeat {repeat} stage {stage} {name}: {times[stage][name][-1]:.4f} s/step", flush=True)
    text = section(times, args, (time.monotonic() - start) / 60)
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "identity_cost", text)


if __name__ == "__main__":
    main()
