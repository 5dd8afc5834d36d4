"""The data check's verdict: ranks that drew the same samples are stopped; equal batches it cannot judge are
warned of once, and training goes on.

At a check every rank contributes its batch's digest (divergence.py's ``batch_digest``) and its source's rows
(data_source.py) to the check's one all-gather (device_check.py), so every rank holds the same table and reaches the
same verdict at the same point. Equal digests only raise the question; the sources answer it:

    the same samples  (the same DistributedSampler positions, or every rank reading all of the data, or a plain
                      loop that gave the guard batches only): ``DuplicateDataError`` on every rank, naming the
                      ranks, what each one reads and the fix;
    other samples     (one DistributedSampler order, other ranks): equal samples, as with a constant dataset or a
                      repeated sample. Nothing to say: DDP trains it, and so does shardlab;
    cannot tell       (an IterableDataset, a batch sampler that hides its sampler, ranks whose samplers differ in
                      order or num_replicas): a warning from rank 0, once per run, naming the ranks and the fix.

Naming what each rank reads exchanges the sources' words (one object all-gather), only when there is a verdict.
"""

from __future__ import annotations

import warnings

from torch import Tensor

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.collectives import Comm
from lightning_shardlab.guard.data_source import DataSource, Source
from lightning_shardlab.guard.divergence import DuplicateDataError

ROWS = 3  # a rank's rows in the check's table: its batch's digest, then its source's two rows


def equal_batches(rows: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """From the gathered table (world, ROWS, 2) on the host: the groups of ranks that drew the same samples, and
    the groups of ranks with equal batches whose sources cannot tell. Pure; the same on every rank."""
    sources = [DataSource.from_rows(r) for r in rows[:, 1:]]
    by_batch: dict[tuple, list[int]] = {}
    for rank, digest in enumerate(rows[:, 0].tolist()):
        by_batch.setdefault(tuple(digest), []).append(rank)
    same, unsure = [], []
    for ranks in (r for r in by_batch.values() if len(r) > 1):
        comparable = {sources[r].comparable for r in ranks}
        if len(comparable) > 1 or None in comparable:
            unsure.append(ranks)
        by_draws: dict[tuple, list[int]] = {}
        for r in ranks:
            if sources[r].draws is not None:
                by_draws.setdefault(sources[r].draws, []).append(r)
        same += [group for group in by_draws.values() if len(group) > 1]
    return sorted(same), sorted(unsure)


class DataVerdicts:
    """The data check over one run: raises on the same samples, warns once of equal batches it cannot judge."""

    def __init__(self) -> None:
        self.warned = False  # the same on every rank: every rank reaches every verdict

    def judge(self, comm: Comm, rows: Tensor, source: DataSource, when: str = "") -> None:
        """Collective on a verdict (every rank holds the same ``rows``, (world, ROWS, 2), on the host):
        ``DuplicateDataError`` on every rank, or a warning (rank 0) the first time; nothing otherwise."""
        same, unsure = equal_batches(rows)
        if not same and (not unsure or self.warned):
            return
        texts = collectives.all_gather_object(source.text, comm, label="sanity data sources")
        kinds = [Source(int(k)) for k in rows[:, 1, 0].tolist()]
        if same:
            raise DuplicateDataError(duplicate_message(comm.rank, same, texts, kinds, when))
        self.warned = True
        if comm.rank == 0:
            warnings.warn(unsure_message(comm.rank, unsure, texts, when), stacklevel=2)


def _ranks(groups: list[list[int]]) -> str:
    return "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in groups)


def _reads(groups: list[list[int]], texts: list[str]) -> str:
    return "; ".join(f"rank {r} reads {texts[r]}" for ranks in groups for r in ranks)


def duplicate_message(rank: int, same: list[list[int]], texts: list[str], kinds: list[Source], when: str) -> str:
    where = f" ({when})" if when else ""
    first = kinds[same[0][0]]
    if first == Source.SPLIT:
        how = "their DistributedSamplers draw the same indices"
        hint = (
            "build each rank's DistributedSampler with num_replicas=world_size and its own rank (trainer.world_size,"
            " trainer.global_rank), or leave the sampler to Lightning: Trainer(use_distributed_sampler=True)"
        )
    elif first == Source.WHOLE:
        how = "their samplers do not split the data: every rank reads all of it"
        hint = (
            "give each rank its own part of the data: keep Trainer(use_distributed_sampler=True), or build the"
            " DataLoader with a DistributedSampler(num_replicas=world_size, rank=rank)"
        )
    else:
        how = "the guard was given the batches only, and their bytes agree"
        hint = (
            "give each rank its own part of the data with a DistributedSampler(num_replicas=world_size, rank=rank),"
            " or shard an IterableDataset by rank; if the samples are equal by design, pass the DataLoader to"
            " SanityGuard.before_step(step, batch, loader=...) so the guard judges its sampler's indices instead"
        )
    return (
        f"[rank {rank}] identical training batches{where}: {_ranks(same)} received the same batch ({how};"
        f" {_reads(same, texts)}), so they compute the same gradients and the run trains on 1/N of the data it pays"
        f" for. HINT: {hint}."
    )


def unsure_message(rank: int, unsure: list[list[int]], texts: list[str], when: str) -> str:
    where = f" ({when})" if when else ""
    return (
        f"[rank {rank}] equal training batches{where} on {_ranks(unsure)}, and the guard cannot tell whether they"
        f" drew the same samples ({_reads(unsure, texts)}). Training goes on, as under DDP; this is said once."
        " HINT: if each rank should read its own part of the data, shard the IterableDataset by rank"
        " (torch.distributed.get_rank() and get_world_size()) or use a map-style dataset with a"
        " DistributedSampler, whose indices the guard can judge; if the samples are equal by design (a constant"
        " or repeated sample), nothing needs fixing, and ShardLabSanity(check_data=False) silences the data check."
    )
