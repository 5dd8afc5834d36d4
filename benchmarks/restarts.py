"""Reliability of restarts: each stage restarted by torchrun 20 times, every restart counted as resumed or not.

    python -m benchmarks.restarts                         # 20 restarts per stage, 2 CPU ranks (gloo)
    python -m benchmarks.restarts --restarts 3 --out /tmp/restarts_smoke.md

Each stage is one torchrun launch of ``lightning_shardlab.examples.resumable`` with ``--max-restarts N`` and a
chain of N runs of that stage (3 epochs of 4 steps, ``last.ckpt`` at each epoch's end): attempt k loses rank 1
(``os._exit``) once step 5 of the k-th run is done, torchrun starts both ranks again, and attempt k + 1 resumes
that run and starts the next; the last attempt resumes the last run. A restart counts as resumed when its run
started again from step 4 (the last complete checkpoint) and ended on the weights of Lightning DDP's restart of
the same run (killed the same way, launched again), bit for bit; a restart whose groups failed to form would
use up the job's restarts, and the runs after it would not resume. Also measured: the seconds from a kill to the
resumed run's start (torchrun noticing, both processes starting again, the groups formed, the checkpoint read).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("shardlab_stage_1", "shardlab_stage_2", "shardlab")
DIE_AT = 5


def launch(out: Path, chain: list[str], restarts: int, launch_index: int = 0) -> tuple[int, str, float]:
    """One torchrun launch of the resumable job: (exit code, output, seconds)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", str(restarts), "--monitor-interval", "0.2",
        "-m", "lightning_shardlab.examples.resumable", "--out", str(out), "--chain", ",".join(chain),
        "--die-at-step", str(DIE_AT),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RESUMABLE_LAUNCH": str(launch_index)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    started = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60 + 60 * len(chain))
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


def ddp_reference(out: Path) -> dict[str, torch.Tensor]:
    """Lightning DDP killed at the same step, then launched again (a fresh launch: see the README)."""
    launch(out, ["ddp"], 0)
    code, output, _ = launch(out, ["ddp"], 0, launch_index=1)
    assert code == 0, output[-4000:]
    return torch.load(out / "ddp" / "final.pt")


def stage_restarts(out: Path, stage: str, n: int, reference: dict[str, torch.Tensor]) -> dict:
    chain = [f"{stage}@{k}" for k in range(n)]
    code, output, seconds = launch(out, chain, n)
    resumed, gaps = 0, []
    for k, name in enumerate(chain):
        diary = out / name / "attempts.jsonl"
        events = [json.loads(line) for line in diary.read_text().splitlines()] if diary.exists() else []
        shape = [(e["attempt"], e["event"], e["step"]) for e in events]
        final = out / name / "final.pt"
        equal = final.exists() and all(torch.equal(v, torch.load(final)[key]) for key, v in reference.items())
        if shape == [(k, "start", 0), (k, "hurt (exit)", DIE_AT), (k + 1, "start", 4)] and equal:
            resumed += 1
            gaps.append(events[2]["time"] - events[1]["time"])
    return {
        "stage": stage, "restarts": n, "resumed": resumed, "exit": code, "seconds": seconds,
        "kill_to_resume_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
    }  # fmt: skip


def report(rows: list[dict], path: Path) -> None:
    lines = [
        "# Restarts: each stage restarted by torchrun, every restart resumed or not",
        "",
        f"`python -m benchmarks.restarts --restarts {rows[0]['restarts']}` on {os.cpu_count()} CPU cores,"
        f" {datetime.now(timezone.utc):%Y-%m-%d}, torch {torch.__version__}: 2 ranks (gloo), one torchrun launch per"
        " stage; rank 1 killed once step 5 is done; resumed = restarted from step 4 and ended on the weights of"
        " Lightning DDP's restart of the same run, bit for bit.",
        "",
        "| stage | restarts | resumed | job exit | launch seconds | kill to resumed start, median s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        gap = f"{r['kill_to_resume_s']:.1f}" if r["kill_to_resume_s"] is not None else "-"
        lines.append(f"| {r['stage']} | {r['restarts']} | {r['resumed']} | {r['exit']} | {r['seconds']:.0f} | {gap} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "RESTARTS.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardlab-restarts-") as tmp:
        reference = ddp_reference(Path(tmp) / "ddp")
        rows = [stage_restarts(Path(tmp) / stage, stage, args.restarts, reference) for stage in args.stages.split(",")]
    report(rows, Path(args.out))


if __name__ == "__main__":
    main()
