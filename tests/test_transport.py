"""The pairwise transport computes exactly what the built-in collectives do; training with it is exact."""

from __future__ import annotations

import pytest
import torch

from lightning_shardlab.comm import collectives
from lightning_shardlab.comm.transport import Builtin, Pairwise
from tests.helpers.launch import run_ranks
from tests.helpers.reference import init_from_env, shutdown


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


# ---- the verified wire: the same results, and ranks that part are named, whatever the sizes ----


def wire_agrees(numel: int, limit: int) -> dict:
    """Every verified operation against the unverified one, with payloads below and above the wire's limit."""
    comm = init_from_env()
    world, s = comm.world_size, numel // comm.world_size
    shard, full = _inputs(comm.rank, numel, world)
    plain = {}
    for verified in (False, True):
        if verified:
            collectives.enable_verification(comm, limit)
        gathered, reduced = torch.empty(numel), torch.empty(s)
        collectives.all_gather(gathered, shard, comm)
        collectives.reduce_scatter(reduced, full.clone(), comm)
        summed = collectives.all_reduce(full[:5].clone(), comm)
        biggest = collectives.all_reduce(full[:5].clone(), comm, op="max")
        sent = collectives.broadcast(full.clone() if comm.rank == 1 else torch.zeros(numel), comm, src=1)
        objects = collectives.all_gather_object({"rank": comm.rank, "pad": "x" * (comm.rank * 1000)}, comm)
        one = collectives.broadcast_object(list(range(comm.rank + 3)), comm, src=world - 1)
        collectives.barrier(comm)
        plain[verified] = (gathered, reduced, summed, biggest, sent, objects, one)
    shutdown()
    (g0, r0, s0, m0, b0, o0, x0), (g1, r1, s1, m1, b1, o1, x1) = plain[False], plain[True]
    return {
        "gather": torch.equal(g0, g1),
        "reduce": torch.allclose(r0, r1, rtol=1e-6, atol=1e-7),
        "sum": torch.allclose(s0, s1, rtol=1e-6, atol=1e-7),
        "max": torch.equal(m0, m1),
        "broadcast": torch.equal(b0, b1),
        "objects": o0 == o1,
        "object": x0 == x1 == list(range(world + 2)),
    }


@pytest.mark.parametrize(("world_size", "limit"), [(2, 0), (3, 1 << 20), (3, 1 << 10)])
def test_the_verified_wire_computes_what_the_collectives_do(world_size: int, limit: int) -> None:
    """limit 1 KiB: the shards (4 KiB) are larger than the receive room, so their headers are checked first."""
    for report in run_ranks(
        "tests.test_transport:wire_agrees", world_size, {"numel": 3 * 1024, "limit": limit}, timeout=90
    ):
        assert all(report.values()), report


def wire_parts(case: str) -> str:
    """Rank 1 issues another call than rank 0; every rank must raise, naming both calls, never abort."""
    from lightning_shardlab.comm.mismatch import CollectiveMismatch

    comm = init_from_env()
    collectives.enable_verification(comm, 1 << 12)  # 4 KiB of room
    small, big = torch.ones(8), torch.ones(4096)  # 16 KiB: above the room
    try:
        if case == "sizes" and comm.rank == 1:  # 32 bytes meets 16 KiB... through 4 KiB of room
            collectives.all_gather(torch.empty(2 * big.numel()), big, comm, label="big")
        elif case == "sizes":
            collectives.reduce_scatter(torch.empty(4), small.clone(), comm, label="small")
        elif case == "object" and comm.rank == 1:  # an object gather meets an async all-gather
            collectives.all_gather_object("hello", comm, label="plan")
        else:
            collectives.all_gather(torch.empty(16), small, comm, label="small", async_op=True).wait()
    except CollectiveMismatch as err:
        return str(err)
    finally:
        shutdown()
    return "not caught"


@pytest.mark.parametrize("case", ["sizes", "object"])
def test_ranks_that_part_are_named_whatever_the_sizes(case: str) -> None:
    messages = run_ranks("tests.test_transport:wire_parts", 2, {"case": case}, timeout=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank}] collective #0 differs across ranks (verified before it ran)"), message
    assert messages[0].split(": ", 1)[1] == messages[1].split(": ", 1)[1]


# ---- NCCL's verification, run on gloo: the headers travel beside each call and are checked at its wait ----


def headers_beside_the_call() -> dict:
    """The header exchange NCCL uses (``deferred``: launched beside the call, checked when it is waited for), on
    gloo with payloads of one size (gloo itself would abort on two). Rank 1 launches only once rank 0's launch
    has returned (a store key): a launch that waited for the headers would never return."""
    import torch.distributed as dist

    from lightning_shardlab.comm.mismatch import CollectiveMismatch
    from lightning_shardlab.comm.verify import HeaderExchange, Headers
    from lightning_shardlab.guard.side_channel import default_store

    comm = init_from_env()
    headers = Headers(comm.rank, comm.world_size)
    comm.header_exchange = HeaderExchange.open(headers, twin=dist.new_group(backend="gloo"), deferred=True)
    store, out = default_store(), {}
    shard, full = torch.full((4,), float(comm.rank)), torch.empty(8)
    try:
        if comm.rank == 1:
            store.wait(["rank 0 launched"])
        pending = collectives.all_gather(full, shard, comm, label="blocks.0", async_op=True)
        if comm.rank == 0:
            store.set("rank 0 launched", "1")
        pending.wait()
        out["gathered"] = full.tolist()
        label = "blocks.1" if comm.rank == 0 else "blocks.2"  # the ranks part: same size, other units
        try:
            collectives.all_gather(full, shard, comm, label=label, async_op=True).wait()
            out["mismatch"] = "not caught"
        except CollectiveMismatch as err:
            out["mismatch"] = str(err)
        out["verify_calls"] = comm.ledger.by_call[("world", "verify", "")].count
    finally:
        shutdown()
    return out


def test_nccls_headers_travel_beside_the_call_and_a_mismatch_is_named_at_its_wait() -> None:
    reports = run_ranks("tests.test_transport:headers_beside_the_call", 2, {}, timeout=60)
    for rank, report in enumerate(reports):
        assert report["gathered"] == [0.0] * 4 + [1.0] * 4, report
        message = report["mismatch"]
        assert message.startswith(f"[rank {rank}] collective #1 differs across ranks (verified before it ran)"), message
        assert "blocks.1" in message and "blocks.2" in message, message
        assert report["verify_calls"] == 2, report
