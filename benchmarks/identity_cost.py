"""What one identity per parameter costs: the 14M GPT's step at stages 1-3, before and after, in one run.

    python -m benchmarks.identity_cost --before 476413b          # the commit before one identity
    python -m benchmarks.identity_cost --before 476413b --quick  # 1 repeat, printed, RESULTS.md untouched

"Before" is the package as it was at ``--before`` (``git archive`` into a temporary directory); "after" is this
checkout. Each repeat runs, for each stage, both versions back to back (in turn first) in fresh processes (bench.py's
``sample``: 2 CPU ranks, 1 thread each, gloo, fp32 AdamW, the median of the timed steps after warm-up), so
both meet the same machine load. Reported: the median step of each, and after / before per repeat (median,
min-max). Then, directly: the seconds per step spent inside the code one identity adds (timers around it, in
the "after" run). The section goes into benchmarks/RESULTS.md.
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


# what one identity adds to a step, by where it runs: (module, owner attribute or None, function name)
ADDED = (
    ("lightning_shardlab.sharding.flat_param", "FlatParam", "adopt_replaced"),  # each unit's forward, each save
    ("lightning_shardlab.sharding.flat_param", "FlatParam", "_show"),  # data swaps (stage 3: twice per unit)
    ("lightning_shardlab.sharding.optimizer", None, "masters_in_place"),  # the update, and loads
    ("lightning_shardlab.sharding.sharded_model", "ShardedModel", "flat_params_of"),  # after each step
)


def timed_rank(stage: int, warmup: int, steps: int) -> dict:
    """One rank of the 'after' run with the code one identity adds wrapped in timers: its seconds per step."""
    import contextlib
    import functools
    import importlib

    from benchmarks.bench import run_lightning

    spent = {name: 0.0 for _, _, name in ADDED}

    def timed(fn, name):  # noqa: ANN001, ANN202
        if name == "masters_in_place":

            @contextlib.contextmanager
            def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                start = time.perf_counter()
                with fn(*args, **kwargs):
                    spent[name] += time.perf_counter() - start
                    yield  # the optimizer's own update is not counted
                    start = time.perf_counter()
                spent[name] += time.perf_counter() - start

            return wrapper

        @functools.wraps(fn)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    for module_name, owner, name in ADDED:
        module = importlib.import_module(module_name)
        target = getattr(module, owner) if owner else module
        setattr(target, name, timed(getattr(target, name), name))
    result = run_lightning(f"shardlab_stage_{stage}", "default", warmup, steps)
    return {"step": statistics.median(result["times"]), **{k: v / (warmup + steps) for k, v in spent.items()}}


def direct(stages: list[int], warmup: int, steps: int) -> dict:
    """Per stage: rank 0's step and the seconds per step inside each added function (nested calls counted once:
    ``_show`` includes the ``adopt_replaced`` it calls)."""
    from benchmarks.ranks import run_ranks

    return {stage: run_ranks(timed_rank, 2, {"stage": stage, "warmup": warmup, "steps": steps})[0] for stage in stages}


def section(times: dict, args: argparse.Namespace, minutes: float, spent: dict) -> str:
    begin, end = MARKERS["identity_cost"]
    lines = [
        begin,
        "## What one identity per parameter costs\n",
        f"Command: `python -m benchmarks.identity_cost --before {args.before} --repeats {args.repeats}`"
        f" ({minutes:.1f} min). The default setting's GPT (13,816,704 parameters), 2 ranks, fp32 AdamW; each"
        " repeat runs both versions of each stage back to back, in turn first. Before: the package at"
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
    names = [name for _, _, name in ADDED]
    lines += [
        "",
        "Direct (after, in the same run): the time per step inside the code one identity adds, on rank 0, and its share"
        " of the step (`_show` includes the `adopt_replaced` it calls; `masters_in_place` excludes the update it"
        " wraps). The step ratios above scatter by a few percent either way from one repeat to the next; this is"
        " what the change itself spends.\n",
        "| stage | step, s | " + " | ".join(f"`{n}`, ms" for n in names) + " | all, share of the step |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " | --- |",
    ]
    for stage in args.stages:
        row = spent[stage]
        total = row["_show"] + row["masters_in_place"] + row["flat_params_of"]
        total += 0.0 if stage == 3 else row["adopt_replaced"]  # at stages 1-2 it runs outside _show too
        lines.append(
            f"| {stage} | {row['step']:.4f} | "
            + " | ".join(f"{1000 * row[n]:.3f}" for n in names)
            + f" | {100 * total / row['step']:.3f} % |"
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
                order = list(trees.items()) if repeat % 2 == 0 else list(trees.items())[::-1]  # neither always first
                for name, tree in order:
                    times[stage][name].append(one_sample(tree, stage, args.warmup, args.steps))
                    print(f"repeat {repeat} stage {stage} {name}: {times[stage][name][-1]:.4f} s/step", flush=True)
    spent = direct(args.stages, args.warmup, args.steps)
    text = section(times, args, (time.monotonic() - start) / 60, spent)
    print(text)
    if not args.quick:
        replace_section(HERE / "RESULTS.md", "identity_cost", text)


if __name__ == "__main__":
    main()
