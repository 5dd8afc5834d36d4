"""Collective fingerprints, replicated-state digests and the data check: each injected fault is reported on
every rank, naming the right rank, at the stated point; 100 healthy steps at every stage raise nothing.

Bounds: the strict check raises before the differing collective runs; the cheap checks (every K steps)
raise at the first check after the fault, i.e. within K steps.
"""

from __future__ import annotations

import os
import re
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_shardlab import Comm, ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.mismatch import CollectiveMismatch, first_difference
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.divergence import DivergenceError, DuplicateDataError, tensor_digest
from lightning_shardlab.guard.fingerprints import FingerprintRecorder
from lightning_shardlab.guard.sanity_guard import SanityConfig, SanityGuard
from tests.helpers.counting import counting_collectives
from tests.helpers.launch import run_commands, run_ranks
from tests.helpers.reference import init_from_env, shutdown
from tests.models import Block, GroupedGPT, OrderedData, TinyCNN, TinyGPT, image_dataset, token_dataset
from tests.test_trainer import QUIET


class SkippableBlock(Block):
    pass


class SkippableNet(nn.Module):
    """Three same-shaped block units, a frozen block, a replicated buffer, BatchNorm statistics; ``skip``
    leaves one block out of forward (the fault: a unit, and so its collectives, skipped on one rank). The
    default policy would not make units of blocks run under an ``if``: the fault needs them named."""

    UNITS = ("tests.test_sanity.SkippableBlock",)

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.blocks = nn.ModuleList([SkippableBlock(15) for _ in range(3)])
        self.frozen = Block(15).requires_grad_(False)
        self.norm = nn.BatchNorm1d(15)
        self.out = nn.Linear(15, 3)
        self.register_buffer("mask", torch.linspace(0.5, 1.5, 15))
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x)) * self.mask
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                h = block(h)
        return self.out(self.frozen(h))


def nudge(t: torch.Tensor, index: int = 0) -> None:
    """One ulp up at ``index`` (flat)."""
    flat = t.data.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype))


# ---- the faults, each in a fresh model on the same process group ----


def _inject(name: str, step: int, rank: int, model: SkippableNet, sharded, optimizer, comm: Comm) -> None:
    """Runs at the end of each step (after the optimizer step)."""
    if name == "mismatch_cheap" and step == 1:  # same size, so gloo runs it: only the fingerprints differ
        collectives.all_reduce(torch.zeros(4), comm, label="loss scale" if rank == 1 else "grad stats")
    if name == "ulp_param" and step == 5 and rank == 1:
        sharded.units[1].wait_gathers()  # the refresh after the step would overwrite the nudge
        nudge(sharded.units[1].flat_params[0].full, index=3)  # blocks.0, inside rank 0's shard
    if name == "ulp_frozen" and step == 4 and rank == 1:  # frozen: never refreshed, the difference persists
        frozen = next(fp for fp in sharded.flat_params if not fp.layout.requires_grad)
        nudge(frozen.full, index=20)
    if name == "ulp_buffer" and step == 1 and rank == 2:
        nudge(model.mask, index=4)
    if name == "lr" and step == 1 and rank == 1:
        group = optimizer.param_groups[0]
        group["lr"] = float(
            torch.nextafter(torch.tensor(group["lr"], dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
        )
    if name == "step_counter" and step == 1 and rank == 2:
        state = next(s for s in optimizer.state.values() if "step" in s)
        state["step"] += 1


SCENARIOS = {  # name: (stage, every_n_steps, strict, verified)
    "mismatch_strict": (3, 3, True, False),
    "skip_strict": (3, 3, True, False),
    "mismatch_cheap": (3, 2, False, False),
    "mismatch_verified": (3, 3, False, True),
    "skip_verified": (3, 3, False, True),
    "ulp_param": (2, 3, False, True),
    "ulp_frozen": (1, 3, False, True),
    "ulp_buffer": (3, 3, False, True),
    "lr": (1, 3, False, True),
    "step_counter": (3, 3, False, True),
    "duplicate": (3, 2, False, True),
}


def run_scenario(name: str, steps: int = 8) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stage, every, strict, verified = SCENARIOS[name]
    comm = Comm(rank=rank, world_size=world, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = SkippableNet()
    sharded = shard_model(model, ShardLabConfig(stage=stage, unit_classes=SkippableNet.UNITS), comm)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    shard_optimizer(optimizer, sharded)
    g = torch.Generator().manual_seed(1)
    config = SanityConfig(
        every_n_steps=every,
        strict_collectives=strict,
        verify_collectives=verified,
        collective_timeout_s=None,
        handle_sigterm=False,
    )
    step, before_rogue = -1, 0
    try:
        with SanityGuard(sharded, [optimizer], config) as guard, counting_collectives() as calls:
            for step in range(steps):
                x, y = torch.randn(2 * world, 7, generator=g), torch.randn(2 * world, 3, generator=g)
                mine = 0 if name == "duplicate" and step == 4 and rank == 2 else rank
                batch = (x[2 * mine : 2 * mine + 2], y[2 * mine : 2 * mine + 2])
                guard.before_step(step, batch)
                if name in ("mismatch_strict", "mismatch_verified") and step == 2:  # sizes differ: gloo would abort
                    before_rogue = calls["all_reduce"]
                    collectives.all_reduce(torch.zeros(5 if rank == 2 else 4), comm, label="rogue")
                model.skip = 1 if name in ("skip_strict", "skip_verified") and step == 2 and rank == 1 else None
                optimizer.zero_grad()
                with sharded.step(keep_root_gathered=True):
                    loss = F.mse_loss(model(batch[0]), batch[1])
                sharded.prepare_backward(loss)
                loss.backward()
                optimizer.step()
                _inject(name, step, rank, model, sharded, optimizer, comm)
    except (CollectiveMismatch, DivergenceError, DuplicateDataError) as error:
        rogue_ran = calls["all_reduce"] - before_rogue if name.startswith("mismatch_") else None
        return {"error": type(error).__name__, "message": str(error), "step": step, "rogue_ran": rogue_ran}
    return {"error": None, "step": step}


DEFERRED = ("ulp_param", "duplicate")  # run again with the verdict a GPU gives (guard/device_check.py)


def all_faults() -> dict:
    """Every scenario, then ``DEFERRED`` again with the verdict given at the next step's start (under
    ``deferred <name>``), in one launch."""
    from lightning_shardlab.guard import device_check

    init_from_env()
    reports = {name: run_scenario(name) for name in SCENARIOS}
    device_check.DEFER = True
    try:
        reports.update({f"deferred {name}": run_scenario(name) for name in DEFERRED})
    finally:
        device_check.DEFER = False
        shutdown()
    return reports


@pytest.fixture(scope="module")
def fault_reports() -> list[dict]:
    return run_ranks("tests.test_sanity:all_faults", 3, timeout=240)


def _each_rank(reports: list[dict], name: str) -> list[dict]:
    return [r[name] for r in reports]


@pytest.mark.parametrize(("name", "check"), [("mismatch_strict", "strict check"), ("mismatch_verified", "verified")])
def test_a_mismatched_collective_is_stopped_before_it_runs(fault_reports: list[dict], name: str, check: str) -> None:
    """Strict mode through the store; verified collectives (the default) by their header."""
    for rank, r in enumerate(_each_rank(fault_reports, name)):
        assert r["error"] == "CollectiveMismatch" and r["step"] == 2, r
        assert r["message"].startswith(f"[rank {rank}] collective #")
        assert "rank 0, 1 issued" in r["message"] and "all_reduce 'rogue' numel=4 float32" in r["message"]
        assert "rank 2 issued" in r["message"] and "all_reduce 'rogue' numel=5 float32" in r["message"]
        assert f"({check}" in r["message"] and "before it ran" in r["message"] and "HINT:" in r["message"]
        assert r["rogue_ran"] == 0  # the differing all-reduce never reached torch.distributed


@pytest.mark.parametrize("name", ["skip_strict", "skip_verified"])
def test_a_skipped_unit_is_named(fault_reports: list[dict], name: str) -> None:
    """Which block the differing call gathers depends on the prefetch order; that rank 1 is the odd one,
    and that the two fingerprints are named, does not."""
    for r in _each_rank(fault_reports, name):
        assert r["error"] == "CollectiveMismatch" and r["step"] == 2, r
        found = re.search(
            r"rank 0, 2 issued #(\d+) all_gather 'blocks\.(\d)\[float32\]' numel=\d+ float32; rank 1"
            r" issued #\1 all_gather 'blocks\.(\d)\[float32\]'",
            r["message"],
        )
        assert found and found[2] != found[3], r["message"]
        if name == "skip_verified":  # and which unit each rank gathered, and the fix
            assert f"rank 1 gathered unit 'blocks.{found[3]}'" in r["message"], r["message"]
            assert "leave tests.test_sanity.SkippableBlock out of unit_classes" in r["message"], r["message"]


def test_cheap_check_names_both_fingerprints_at_the_next_check(fault_reports: list[dict]) -> None:
    for r in _each_rank(fault_reports, "mismatch_cheap"):
        assert r["error"] == "CollectiveMismatch" and r["step"] == 2, r  # fault in step 1, check before step 2
        assert "rank 0, 2 issued" in r["message"] and "all_reduce 'grad stats' numel=4" in r["message"]
        assert "rank 1 issued" in r["message"] and "all_reduce 'loss scale' numel=4" in r["message"]


@pytest.mark.parametrize(
    ("name", "step", "odd", "what"),
    [
        (
            "ulp_param",
            6,
            1,
            "flat parameter blocks.0[float32] on rank 1 differs from rank 0: 1 element(s) differ;"
            " first in parameter 'blocks.0.l1.weight' at index (0, 3)",
        ),
        (
            "ulp_frozen",
            6,
            1,
            "flat parameter root[float32,frozen] on rank 1 differs from rank 0: 1 element(s) differ;"
            " first in parameter 'frozen.l1.weight' at index (1, 5)",
        ),
        ("ulp_buffer", 3, 2, "buffer mask on rank 2 differs from rank 0: 1 element(s) differ; first at index (4,)"),
        (
            "lr",
            3,
            1,
            "optimizer 0 (AdamW) param group 0 on rank 1 differs from rank 0: lr=0.01 on rank 0,"
            " 0.010000000000000002 on rank 1",
        ),
        (
            "step_counter",
            3,
            2,
            "optimizer 0 (AdamW) param group 0 on rank 2 differs from rank 0: step counters"
            " [3.0] on rank 0, [3.0, 4.0] on rank 2",
        ),
    ],
)
def test_one_ulp_in_one_ranks_replicated_state_is_named_at_the_next_check(
    fault_reports: list[dict], name: str, step: int, odd: int, what: str
) -> None:
    for rank, r in enumerate(_each_rank(fault_reports, name)):
        assert r["error"] == "DivergenceError" and r["step"] == step, r
        assert r["message"].startswith(f"[rank {rank}] silent divergence (before step {step}): {what}"), r["message"]
        assert "HINT:" in r["message"]


def test_ranks_reading_the_same_batch_are_named(fault_reports: list[dict]) -> None:
    for r in _each_rank(fault_reports, "duplicate"):
        assert r["error"] == "DuplicateDataError" and r["step"] == 4, r
        assert "ranks 0, 2 received the same batch" in r["message"] and "DistributedSampler" in r["message"]


def test_a_gpus_verdict_comes_one_step_later_under_the_checks_name(fault_reports: list[dict]) -> None:
    """On a GPU the digests come to the host behind the step's kernels: the check before step 6 (ulp_param)
    and before step 4 (duplicate) are judged as steps 7 and 5 begin, on every rank, named as the check (the nudged
    element was overwritten by step 6's refresh meanwhile: the message says the digests differed)."""
    for rank, r in enumerate(fault_reports):
        ulp, duplicate = r["deferred ulp_param"], r["deferred duplicate"]
        assert ulp["error"] == "DivergenceError" and ulp["step"] == 7, ulp
        assert ulp["message"].startswith(f"[rank {rank}] silent divergence (before step 6): flat parameter blocks.0"), (
            ulp["message"]
        )
        assert "on rank 1 differs from rank 0" in ulp["message"], ulp["message"]
        assert duplicate["error"] == "DuplicateDataError" and duplicate["step"] == 5, duplicate
        assert "(before step 4): ranks 0, 2 received the same batch" in duplicate["message"], duplicate["message"]


# ---- no false alarms: 100 healthy steps per stage, every check on every step, through the Trainer ----


def healthy_fit(steps: int = 100) -> dict:
    """Stage 1: BatchNorm (local statistics, broadcast buffers), SGD + StepLR. Stage 2: a frozen block, two
    param groups, warm-up. Stage 3: tied embeddings. Validation runs in between (more collectives)."""
    out, world = {}, int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for stage, (model_cls, dataset) in {
        1: (TinyCNN, image_dataset),
        2: (GroupedGPT, token_dataset),
        3: (TinyGPT, token_dataset),
    }.items():
        torch.manual_seed(0)
        sanity = ShardLabSanity(every_n_steps=1, strict_collectives=True, collective_timeout_s=60, poll_s=0.2)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ShardLabStrategy(stage=stage),
            max_steps=steps,
            callbacks=[sanity],
            limit_val_batches=2,
            val_check_interval=50,
            **QUIET,
        )
        trainer.fit(model_cls(), OrderedData(dataset(steps * 2 * trainer.world_size), 2))
        out[stage] = {"batches": sanity.batches, "checked": sanity.guard.recorder.count == 0}
    return out


def test_no_false_alarm_in_100_healthy_steps_at_every_stage() -> None:
    for report in run_ranks("tests.test_sanity:healthy_fit", 3, timeout=240):
        assert report == {stage: {"batches": 100, "checked": True} for stage in (1, 2, 3)}


# ---- the callback on a Trainer: duplicated data (no DistributedSampler) is caught at the first step ----


def same_data_fit() -> dict:
    data = token_dataset(16)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ShardLabStrategy(),
        max_steps=4,
        callbacks=[ShardLabSanity(every_n_steps=2)],
        **QUIET,
    )
    try:
        trainer.fit(TinyGPT(), DataLoader(data, batch_size=2))  # use_distributed_sampler=False: every rank reads all
    except DuplicateDataError as error:
        return {"message": str(error), "batches": trainer.callbacks[0].batches}
    return {"message": None}


def test_callback_reports_every_rank_reading_the_same_data() -> None:
    for report in run_ranks("tests.test_sanity:same_data_fit", 2, timeout=120):
        assert report["batches"] == 0 and "ranks 0, 1 received the same batch" in report["message"]


def default_strategy_same_data_fit() -> dict:
    """No callback: the strategy runs the cheap checks by default (sanity_every_n_steps=10, from step 0)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=ShardLabStrategy(), max_steps=4, **QUIET
    )
    try:
        trainer.fit(TinyGPT(), DataLoader(token_dataset(16), batch_size=2))
    except DuplicateDataError as error:
        return {"message": str(error)}
    return {"message": None}


def test_the_strategy_runs_the_checks_by_default() -> None:
    for report in run_ranks("tests.test_sanity:default_strategy_same_data_fit", 2, timeout=120):
        assert report["message"] and "ranks 0, 1 received the same batch" in report["message"]


# ---- pieces without communication ----


def test_tensor_digest_sees_one_ulp_and_a_swap() -> None:
    t = torch.randn(3001, dtype=torch.float32)
    base = tensor_digest(t)
    assert torch.equal(tensor_digest(t.clone()), base)
    for index in (0, 1, 2999, 3000):  # words, both halves of a word, and the bytes after the last whole word
        one_ulp = t.clone()
        nudge(one_ulp, index)
        assert not torch.equal(tensor_digest(one_ulp), base), index
    for a, b in ((4, 6), (0, 200), (1, 2999)):  # same row, other rows: word sums unchanged, positions not
        swapped = t.clone()
        swapped[[a, b]] = t[[b, a]]
        assert tensor_digest(swapped)[0] == base[0] and not torch.equal(tensor_digest(swapped), base), (a, b)
    for dtype in (torch.bfloat16, torch.int64, torch.bool, torch.float64):
        assert tensor_digest(t.to(dtype)).shape == (2,)


def test_first_difference_finds_a_skipped_call() -> None:
    a = [
        (0, "all_gather", "root[float32]", 8, "float32"),
        (1, "all_gather", "blocks.0[float32]", 6, "float32"),
        (2, "all_gather", "blocks.1[float32]", 6, "float32"),
    ]
    b = [a[0], (1, "all_gather", "blocks.1[float32]", 6, "float32")]
    seq, each = first_difference({0: {fp[0]: fp for fp in a}, 1: {fp[0]: fp for fp in b}})
    assert seq == 1 and each == {0: a[1], 1: b[1]}
    recorder = FingerprintRecorder()
    assert recorder.summary().tolist()[0] == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("every_n_steps", -1),
        ("poll_s", 0),
        ("strict_collectives", "yes"),
        ("collective_timeout_s", -5),
        ("skip_buffers", "mask"),
    ],
)
def test_bad_options_name_the_option(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"`{option}="):
        SanityConfig(**{option: value})


# ---- the example: each of break_it.py's three faults is caught, with its message ----


def test_break_it_example_catches_all_three_faults() -> None:
    (out,) = run_commands([[sys.executable, "examples/break_it.py"]], timeout=300)
    assert "summary: diverge: caught, skip: caught, same-data: caught" in out, out
    assert "first in parameter 'wpe.weight'" in out
    assert "(verified before it ran): rank 0 issued #" in out and "gathered unit 'blocks." in out
    assert "ranks 0, 1 received the same batch" in out
