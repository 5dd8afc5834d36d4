"""The pairwise transport computes exactly what the built-in collectives do; training with it is exact."""

from __future__ import annotations

import pytest
import torch

from lightning_shardlab import collectives
from lightning_shardlab.transport import Builtin, Pairwise
from tests.launch import run_ranks
from tests.reference import init_from_env, shutdown


def _inputs(rank: int, numel: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # every rank can rebuild every rank's inputs
    shard = torch.randn(numel // world, generator=g)
    full = torch.randn(numel, generator=g)
    return shard, full


def transports_agree(numel: int) -> dict:
    comm = init_from_env()
    world, s = comm.world_size, numel // comm.world_size
    shard, full = _inputs(comm.rank, numel, world)
    everyone = [_inputs(r, numel, world) for r in range(world)]
    results = {}
    for transport in (Builtin, Pairwise):
        comm.transports = {"all_gather": transport, "reduce_scatter": transport}
        gathered, reduced = torch.empty(numel), torch.empty(s)
        collectives.all_gather(gathered, shard, comm)
        collectives.reduce_scatter(reduced, full.clone(), comm)
        results[transport.name] = (gathered, reduced)
    expected_gather = torch.cat([sh for sh, _ in everyone])
    expected_mean = everyone[0][1][comm.rank * s : (comm.rank + 1) * s].clone()
    for _, f in everyone[1:]:
        expected_mean += f[comm.rank * s : (comm.rank + 1) * s]  # the pairwise sum runs in rank order
    expected_mean /= world
    shutdown()
    return {
        "gather_exact": all(torch.equal(g, expected_gather) for g, _ in results.values()),
        "pairwise_mean_exact": torch.equal(results["pairwise"][1], expected_mean),
        "builtin_mean_close": torch.allclose(results["builtin"][1], expected_mean, rtol=1e-6, atol=1e-7),
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_pairwise_exchange_equals_the_builtin_collectives(world_size: int) -> None:
    for report in run_ranks("tests.test_transport:transports_agree", world_size, {"numel": 12 * 1031}, timeout=90):
        assert report == {"gather_exact": True, "pairwise_mean_exact": True, "builtin_mean_close": True}


def test_training_with_the_pairwise_transport_matches_the_reference() -> None:
    run_ranks("tests.test_parity:core_parity", 3, {"stage": 3, "steps": 4, "transport": "pairwise"}, timeout=120)
