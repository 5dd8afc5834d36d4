"""``shardlab plan`` verdicts against real runs: what the plan says fits trains under a memory cap, what it says
does not fit fails under the same cap, and the change it chooses trains.

The cap. A rank process holds far more than the step's tensors (Python, torch, Lightning, gloo: hundreds of MB),
so the device memory C of the plan is given to each rank *on top of what it already holds*: when ``fit``'s
``setup`` hook runs (imports done, the gloo process group up, the model built on CPU but not yet sharded, no
optimizer state, no step run), a callback reads the rank's private data mappings (``VmData`` in
/proc/self/status) and sets ``RLIMIT_DATA`` to that + C (the process group alone adds ~30 MB, so a cap set
before ``fit`` would charge it to the step). glibc is told to keep one arena
and to serve blocks of 128 KiB and more by mmap, unmapping them when freed (``MALLOC``), so that ``VmData`` follows
the live tensors rather than the allocator's high-water mark (the mechanism of tests/test_meta_init.py). What
the plan's step leaves out (the optimizer's step and its state's first allocation, the allocator's slack, what
Lightning keeps) is small next to the activations of the configuration chosen here (a GPT of long sequences and
few layers), and the margins are wide: X's predicted peak is under 0.4 C, Y's over 2 C, the chosen change's
under 0.7 C.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.cli import plan as plan_command
from lightning_shardlab.examples.gpt import GPT
from tests.helpers.launch import RankFailed, run_ranks

WORLD = 2
SEQ = 1024
GPT_ARGS = {"vocab_size": 128, "block_size": SEQ, "n_layer": 4, "n_head": 4, "n_embd": 128}
MB = 2**20
MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


class Cap(L.Callback):
    """At ``setup`` (the process group up, the model not yet sharded, no step run): RLIMIT_DATA = VmData + cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        limit = _status("VmData") + self.cap
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))


def train(runs: list[dict], cap: int, out: str | None = None) -> list[dict]:
    """Each of ``runs`` (``micro_batch_size``, ``accumulate_grad_batches``, strategy options) trains 2 optimizer
    steps in turn, stage 1 unless set, fp32, under RLIMIT_DATA = its VmData at fit's setup + ``cap`` (``Cap``).
    With ``out``, what the runs so far did is written to ``out/rank{RANK}.json`` after each (every rank's before
    the next run starts), so that a run failing leaves the report of those before it."""
    done = []
    for run in runs:
        options = {"stage": 1, **run}
        b, accumulate = options.pop("micro_batch_size"), options.pop("accumulate_grad_batches", 1)
        torch.manual_seed(0)
        model = GPT(**GPT_ARGS)
        rank_data = torch.Generator().manual_seed(int(os.environ["RANK"]))  # each rank its own batches
        ids = torch.randint(0, GPT_ARGS["vocab_size"], (2 * accumulate * b, SEQ + 1), generator=rank_data)
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy=ShardLabStrategy(**options), precision="32-true",
            max_steps=2, accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[Cap(cap)],
        )  # fmt: skip
        data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=b)
        gc.collect()
        start = time.monotonic()
        trainer.fit(model, data)
        done.append({"run": run, "steps": trainer.global_step, "seconds": time.monotonic() - start})
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        del trainer, model, data
        if out is not None:
            with open(f"{out}/rank{os.environ['RANK']}.json", "w") as f:
                json.dump(done, f)
            torch.distributed.barrier()
    return done


CAP = 128 * MB  # the device memory given to the plan, and to each rank on top of what it holds


def verdict(micro_batch_size: int) -> dict:
    """``shardlab plan``'s verdict for this GPT at ``micro_batch_size`` on 2 ranks, stage 1, fp32, in CAP."""
    argv = [
        "--model", "lightning_shardlab.examples.gpt.GPT", "--init-args", json.dumps(GPT_ARGS),
        "--world-size", str(WORLD), "--stage", "1", "--precision", "32-true",
        "--micro-batch-size", str(micro_batch_size), "--seq-len", str(SEQ), "--device-memory", f"{CAP}B",
    ]  # fmt: skip
    plan = plan_command.make_plan(plan_command.parser().parse_args(argv))
    return {"fits": plan.fits, "peak": plan.step_peak["total"], **plan.fit}


def test_what_the_plan_says_fits_trains_under_the_cap_and_what_it_says_does_not_fails(tmp_path: Path) -> None:
    x, y = verdict(1), verdict(8)
    assert x["fits"] and x["peak"] < 0.4 * CAP, x["peak"] / MB  # X: micro-batch 1
    assert not y["fits"] and y["peak"] > 2 * CAP, y["peak"] / MB  # Y: micro-batch 8
    choice = next(c for c in y["candidates"] if c["name"] == y["choice"])
    assert choice["fits"] and choice["peak"]["total"] < 0.7 * CAP, choice
    fix = {**choice["options"]}  # e.g. micro-batch 2 x 4 accumulation steps: the same 8 sequences per step
    print(f"\ncap {CAP / MB:.0f} MiB; predicted X {x['peak'] / MB:.1f} MiB, Y {y['peak'] / MB:.1f} MiB,"
          f" {choice['name']} {choice['peak']['total'] / MB:.1f} MiB")  # fmt: skip
    # one launch: X and the chosen change, then Y (each under its own cap: what the rank holds at its setup + CAP)
    kwargs = {"runs": [{"micro_batch_size": 1}, fix, {"micro_batch_size": 8}], "cap": CAP, "out": str(tmp_path)}
    with pytest.raises(RankFailed, match="can't allocate memory|out of memory|MemoryError"):  # Y fails
        run_ranks("tests.test_plan_verdicts:train", WORLD, kwargs, timeout=180, env=MALLOC)
    for rank in range(WORLD):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["steps"] for r in runs] == [2, 2], runs  # X and the chosen change trained under the cap
