"""No host waits for the device in a steady step (comm/host_reads.py, comm/host_side.py).

On a GPU a host read of a device value waits for the device's whole queue; the engine and its callbacks read
device values only through ``to_host`` and ``wait_for``, which count them. One 2-rank launch runs:

- the default configuration at stages 1-3 with the budget and the guard (checks every 5 steps here): a steady
  step reads nothing; the guard's check steps read, and only for the guard;
- NCCL's arrangement on CPU ranks: every group gets a gloo twin for host tensors (``host_side.ALWAYS``), so
  the usage bits, the guard's fingerprints, the budget's figures and every object travel there, verified, while
  the flat parameters move on the group itself; the run is the same run, bit for bit.

The same audit on a GPU, with ``torch.cuda.set_sync_debug_mode("error")``, is in tests/test_gpu.py.
"""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch
from rich.console import Console

from lightning_shardlab import ShardLabBudget, ShardLabSanity, ShardLabStrategy
from lightning_shardlab.comm import host_reads, host_side
from tests.helpers.launch import run_ranks
from tests.models.gpt import OrderedData, TinyGPT, token_dataset
from tests.test_trainer import QUIET

GPT = {"vocab": 61, "block_size": 8, "n_layer": 2, "n_embd": 32, "n_head": 4}
STEPS, CHECK_EVERY = 11, 5


class ReadsPerStep(L.Callback):
    """The host reads made between one batch's start and the next's: one step, its end hooks included."""

    def __init__(self) -> None:
        self.before: Counter[str] = Counter()
        self.steps: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:
            self.steps.append(dict(host_reads.READS - self.before))
        self.before = Counter(host_reads.READS)


def fit(out: str, stage: int, twins: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(**GPT)
    reads = ReadsPerStep()
    host_side.ALWAYS = twins
    try:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ShardLabStrategy(stage=stage),
            max_steps=STEPS,
            default_root_dir=out,
            callbacks=[reads, ShardLabBudget(Console(file=io.StringIO())), ShardLabSanity(every_n_steps=CHECK_EVERY)],
            limit_val_batches=0,
            **QUIET,
        )
        trainer.fit(model, OrderedData(token_dataset(STEPS * 2 * 2, vocab=61, block_size=8), 2))
    finally:
        host_side.ALWAYS = False
    comm = trainer.strategy.sharded.comm
    twin = comm.host
    return {
        "reads": reads.steps,
        "weights": {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()},
        "twin": None
        if twin is None
        else {
            "own_group": twin.group is not comm.group,
            "on_host": twin.device.type == "cpu",
            "verified": twin.wire is not None,
            "calls": twin.seq,
        },
    }


def every_case(root: str) -> list[dict[str, Any]]:
    cases = [(1, False), (2, False), (3, False), (3, True)]
    return [fit(str(Path(root) / f"{stage}-{twins}"), stage, twins) for stage, twins in cases]


def test_a_steady_step_reads_nothing_from_the_device_and_host_facts_travel_on_a_twin(tmp_path: Path) -> None:
    ranks = run_ranks("tests.test_host_syncs:every_case", 2, {"root": str(tmp_path)}, timeout=240)
    for rank, cases in enumerate(ranks):
        for stage, case in zip((1, 2, 3, "3 with twins"), cases):
            steps = case["reads"]
            assert len(steps) == STEPS - 1, (rank, stage, steps)
            reading = [i for i, step in enumerate(steps, start=1) if step]
            assert len(reading) <= STEPS // CHECK_EVERY, (rank, stage, steps)  # the guard's check steps only
            assert all(why.startswith("sanity") for step in steps for why in step), (rank, stage, steps)
        plain, twinned = cases[2], cases[3]
        assert plain["twin"] is None
        assert twinned["twin"] == {
            "own_group": True,
            "on_host": True,
            "verified": True,
            "calls": twinned["twin"]["calls"],
        }
        assert twinned["twin"]["calls"] >= STEPS, twinned["twin"]  # the usage bits every step, and more
        for name, value in plain["weights"].items():
            assert torch.equal(value, twinned["weights"][name]), (rank, name)
