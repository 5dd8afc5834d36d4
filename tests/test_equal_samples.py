"""Equal samples are not duplicated data: the data check judges each rank's sampler, not the batch's bytes.

A dataset whose samples are all equal (Lightning's own tests use ``DataLoader([1] * 10)``) gives every rank the
same bytes while Lightning's DistributedSampler hands each rank its own indices; DDP trains it, and so must shardlab
with its guard checking every step. An IterableDataset's equal batches cannot be judged: a warning, once, and the
run trains as under DDP. A sampler that gives every rank the same indices is still stopped at the first check.
One launch on 2 ranks serves every case; the verdicts' rules are checked without communication below.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.data_source import DataSource, Source, describe
from lightning_shardlab.guard.divergence import DuplicateDataError
from lightning_shardlab.guard.duplicate_data import equal_batches
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32

STEPS = 4
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
UNSURE = "equal training batches"  # the warning's words (guard/duplicate_data.py)


def equal_samples(n: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` copies of one (input, target) sample: every batch of every rank has the same bytes."""
    g = torch.Generator().manual_seed(3)
    sample = (torch.randn(4, generator=g), torch.randn(2, generator=g))
    return [sample] * n


class RepeatedStream(IterableDataset):
    """An IterableDataset that yields the same sample on every rank: what each rank reads cannot be known."""

    def __iter__(self):  # noqa: ANN204
        yield from equal_samples()


class EqualSampleNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(world: int, strategy: object, loader: DataLoader, **trainer: object) -> dict:
    """One fit; what it ended with: the error's type and message, the warnings of the data check, the guard's
    batches and (shardlab) the consolidated weights."""
    model = EqualSampleNet()
    sanity = ShardLabSanity(every_n_steps=1, collective_timeout_s=60, poll_s=0.2)
    callbacks = [sanity] if isinstance(strategy, ShardLabStrategy) else []
    run = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        **QUIET,
        **trainer,
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run.fit(model, loader)
        except DuplicateDataError as e:
            error = e
    out = {
        "error": None if error is None else str(error),
        "warnings": [str(w.message) for w in caught if UNSURE in str(w.message)],
        "batches": sanity.batches if callbacks else run.global_step,
    }
    if error is None:
        full = run.strategy.full_state_dict() if callbacks else model.state_dict()
        out["weights"] = {k: v.detach().cpu().clone() for k, v in full.items()}
    return out


def equal_samples_world() -> dict:
    """Every case on one set of ranks: the ones that train first, then the ones that must be stopped."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # read once: Lightning's teardown removes them
    batch = dict(batch_size=2)
    out = {"ddp": _fit(world, "ddp", DataLoader(equal_samples(), **batch))}  # Lightning's sampler, as by default
    for stage in (1, 2, 3):
        out[f"stage {stage}"] = _fit(world, ShardLabStrategy(stage=stage), DataLoader(equal_samples(), **batch))
    out["ddp stream"] = _fit(world, "ddp", DataLoader(RepeatedStream(), **batch))
    out["stream"] = _fit(world, ShardLabStrategy(stage=3), DataLoader(RepeatedStream(), **batch))
    wrong = {
        "one replica": DistributedSampler(equal_samples(), num_replicas=1, rank=0),
        "same rank": DistributedSampler(equal_samples(), num_replicas=world, rank=0, shuffle=True),
        "plain shuffle": None,  # RandomSampler over the whole dataset on every rank
    }
    for name, sampler in wrong.items():
        torch.manual_seed(rank)  # a RandomSampler draws its own seed: the ranks' orders differ, the bytes do not
        loader = DataLoader(equal_samples(), sampler=sampler, shuffle=sampler is None, **batch)
        out[name] = _fit(world, ShardLabStrategy(stage=2), loader, use_distributed_sampler=False)
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks("tests.test_equal_samples:equal_samples_world", 2, timeout=240)


def _same_weights(weights: dict, reference: dict, where: str) -> None:
    assert list(weights) == list(reference), where
    for key, value in reference.items():
        assert_close(weights[key], value, **FP32, msg=lambda m, k=key: f"{where} {k}\n{m}")


def test_equal_samples_under_lightnings_sampler_train_as_ddp_at_every_stage(reports: list[dict]) -> None:
    """Every rank's batches have the same bytes, every step is checked, and nothing is reported: the ranks'
    DistributedSamplers draw other indices. The weights are DDP's."""
    for report in reports:
        assert report["ddp"]["error"] is None and report["ddp"]["batches"] == STEPS
        for stage in (1, 2, 3):
            run = report[f"stage {stage}"]
            assert run["error"] is None and run["warnings"] == [] and run["batches"] == STEPS, (stage, run)
    for stage in (1, 2, 3):  # the consolidated weights are rank 0's
        _same_weights(reports[0][f"stage {stage}"]["weights"], reports[0]["ddp"]["weights"], f"stage {stage}")
    initial = EqualSampleNet().state_dict()
    assert not torch.equal(reports[0]["ddp"]["weights"]["net.0.weight"], initial["net.0.weight"])  # it trained


def test_equal_batches_from_an_iterable_dataset_warn_once_and_train(reports: list[dict]) -> None:
    """The guard cannot see what an IterableDataset hands each rank: rank 0 warns once (the check ran before each
    of the 4 steps), naming the ranks, the dataset and the fix; the run trains to DDP's weights."""
    for rank, report in enumerate(reports):
        run = report["stream"]
        assert run["error"] is None and run["batches"] == STEPS, run
        assert len(run["warnings"]) == (1 if rank == 0 else 0), run["warnings"]
    _same_weights(reports[0]["stream"]["weights"], reports[0]["ddp stream"]["weights"], "stream")
    (text,) = reports[0]["stream"]["warnings"]
    assert text.startswith("[rank 0] equal training batches (before step 0) on ranks 0, 1"), text
    assert "rank 0 reads an IterableDataset (RepeatedStream); rank 1 reads an IterableDataset" in text, text
    assert "Training goes on, as under DDP; this is said once." in text
    assert "HINT: if each rank should read its own part of the data, shard the IterableDataset by rank" in text
    assert "ShardLabSanity(check_data=False)" in text


@pytest.mark.parametrize(
    ("name", "how", "reads", "fix"),
    [
        (
            "one replica",
            "their DistributedSamplers draw the same indices",
            "rank 1 reads DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=0)",
            "num_replicas=world_size and its own rank",
        ),
        (
            "same rank",
            "their DistributedSamplers draw the same indices",
            "rank 1 reads DistributedSampler(num_replicas=2, rank=0, shuffle=True, seed=0)",
            "num_replicas=world_size and its own rank",
        ),
        (
            "plain shuffle",
            "their samplers do not split the data: every rank reads all of it",
            "rank 1 reads a RandomSampler over all 24 samples (no DistributedSampler)",
            "keep Trainer(use_distributed_sampler=True)",
        ),
    ],
)
def test_a_sampler_that_gives_every_rank_the_same_indices_is_still_stopped(
    reports: list[dict], name: str, how: str, reads: str, fix: str
) -> None:
    """At the first check (before step 0), on every rank, naming the ranks, what each reads and the fix."""
    for rank, report in enumerate(reports):
        run = report[name]
        assert run["batches"] == 0 and run["error"], run
        assert run["error"].startswith(f"[rank {rank}] identical training batches (before step 0): ranks 0, 1"), run
        assert how in run["error"] and reads in run["error"] and fix in run["error"].split("HINT:")[1], run["error"]


# ---- the verdicts' rules, without communication ----

DATA = equal_samples(10)


def _table(sources: list[DataSource], digests: list[int] | None = None) -> torch.Tensor:
    """The check's gathered table (world, 3, 2): each rank's batch digest, then its source's rows."""
    digests = digests or [7] * len(sources)
    return torch.stack([torch.cat([torch.tensor([[d, d]]), s.rows()]) for d, s in zip(digests, sources)])


def _split(rank: int, num_replicas: int = 2, **kwargs: object) -> DataSource:
    sampler = DistributedSampler(DATA, num_replicas=num_replicas, rank=rank, **kwargs)
    return describe(DataLoader(DATA, sampler=sampler, batch_size=2))


def test_describe_reads_the_sampler_without_drawing_from_it() -> None:
    state = torch.random.get_rng_state()
    assert _split(1).kind == Source.SPLIT and _split(1).text.startswith("DistributedSampler(num_replicas=2, rank=1")
    assert describe(DataLoader(DATA, shuffle=True)).kind == Source.WHOLE
    assert describe(DataLoader(RepeatedStream())).text == "an IterableDataset (RepeatedStream)"
    batches = torch.utils.data.BatchSampler(DistributedSampler(DATA, num_replicas=2, rank=1), 2, False)
    assert describe(DataLoader(DATA, batch_sampler=batches)).rank == _split(1).rank  # a batch sampler over one
    assert describe([DataLoader(DATA), DataLoader(RepeatedStream())]).kind == Source.OPAQUE  # the least certain
    assert describe(None).kind == Source.BYTES_ONLY
    assert torch.equal(torch.random.get_rng_state(), state)  # a RandomSampler would have drawn a seed


@pytest.mark.parametrize(
    ("sources", "digests", "same", "unsure"),
    [
        ([_split(0), _split(1)], None, [], []),  # equal samples, other indices
        ([_split(0, 3), _split(1, 3), _split(0, 3)], None, [[0, 2]], []),  # ranks 0 and 2 share the sampler's rank
        ([_split(0, seed=0), _split(1, seed=1)], None, [], [[0, 1]]),  # two orders: cannot tell
        ([_split(0, 1), _split(0, 1)], [1, 2], [], []),  # the same indices, other bytes (datasets of their own)
        ([describe(DataLoader(DATA))] * 2, None, [[0, 1]], []),  # no sampler splits the data
        ([describe(DataLoader(RepeatedStream()))] * 3, [5, 5, 6], [], [[0, 1]]),
        ([describe(None)] * 3, [1, 2, 1], [[0, 2]], []),  # batches only (a plain loop): the bytes decide
    ],
)
def test_equal_batches_are_judged_by_the_ranks_sources(
    sources: list[DataSource], digests: list[int] | None, same: list, unsure: list
) -> None:
    assert equal_batches(_table(sources, digests)) == (same, unsure)
