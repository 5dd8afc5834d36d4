"""A rank that raises, is killed or hangs ends the run on every rank, and every rank's log names it.

Bounds (guard/watchdog.py), with this file's settings (poll_s=0.2, grace_s=5, collective_timeout_s=5):
    raise, kill  poll_s + ack_s + grace_s after the fault        (< 11 s)
    hang         collective_timeout_s + poll_s + ack_s + grace_s  (< 16 s, well inside "timeout + 30 s")
Each run's harness timeout is the time to start the ranks (imports, setup: < 60 s on 2 busy cores) plus
the bound plus 30 s, so a run that is not ended in time fails the test.
"""

from __future__ import annotations

import os
import re
import signal
import time

import lightning as L
import torch
import torch.nn.functional as F

from lightning_shardlab import Comm, ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab.guard.callback import ShardLabSanity
from lightning_shardlab.guard.sanity_guard import SanityConfig, SanityGuard
from tests.helpers.launch import run_ranks
from tests.helpers.reference import init_from_env
from tests.models import OddNet, OrderedData, TinyGPT, regression_batches, token_dataset
from tests.test_trainer import QUIET

FAULT_STEP = 5
WATCH = dict(collective_timeout_s=5.0, poll_s=0.2, grace_s=5.0, heartbeat_timeout_s=5.0)
STARTUP_S = 60.0


class FaultyGPT(TinyGPT):
    """At step 5, on one rank: raise, be killed, hang in Python, or get SIGTERM."""

    def __init__(self, fault: str, fault_rank: int) -> None:
        super().__init__(n_layer=2)
        self.fault, self.fault_rank = fault, fault_rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == FAULT_STEP and self.global_rank == self.fault_rank:
            if self.fault == "raise":
                raise ValueError(f"injected failure on rank {self.global_rank}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                time.sleep(3600)  # a rank stuck in its own code: it never reaches the next collective
            if self.fault == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def faulty_fit(fault: str, fault_rank: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardLabStrategy(),
        max_steps=20,
        callbacks=[ShardLabSanity(every_n_steps=4, **WATCH)],
        **QUIET,
    )
    trainer.fit(FaultyGPT(fault, fault_rank), OrderedData(token_dataset(20 * 2 * world), 2))


def _launch(fault: str, fault_rank: int, world: int, bound_s: float) -> list[tuple[int, str]]:
    return run_ranks(
        "tests.test_watchdog:faulty_fit",
        world,
        {"fault": fault, "fault_rank": fault_rank},
        timeout=STARTUP_S + bound_s + 30,
        expect_failure=True,
    )


def test_a_rank_that_raises_ends_every_rank_and_is_named() -> None:
    results = _launch("raise", 1, world=2, bound_s=0.2 + 5 + 5)
    (rc0, log0), (rc1, log1) = results
    assert rc1 != 0 and "ValueError: injected failure on rank 1" in log1
    assert rc0 != 0, log0
    assert "[rank 0] cause: rank 1 failed with ValueError: injected failure on rank 1 (at " in log0
    assert "test_watchdog.py" in log0 and "in training_step)" in log0
    assert "[rank 0] HINT: fix rank 1's error" in log0


def test_a_killed_rank_ends_every_rank_and_is_named() -> None:
    results = _launch("kill", 2, world=3, bound_s=0.2 + 5 + 5)
    assert results[2][0] == -signal.SIGKILL
    for rank, (rc, log) in enumerate(results[:2]):
        assert rc != 0, log
        assert f"[rank {rank}] cause: rank 2 ended without reporting an error:" in log, log
        assert re.search(rf"\[rank {rank}\]   rank 2: its process \d+ on \S+ has ended \(killed\?\)", log), log


def test_a_killed_store_host_ends_the_other_ranks() -> None:
    """Rank 0 hosts the rendezvous store (env://): when it dies, the others learn it from the store itself."""
    (rc0, _), (rc1, log1) = _launch("kill", 0, world=2, bound_s=0.2 + 5 + 5)
    assert rc0 == -signal.SIGKILL
    assert rc1 != 0 and "[rank 1] cause: rank 1 lost the rendezvous store" in log1, log1


def test_a_hang_is_diagnosed_with_the_missing_rank_and_where_it_is() -> None:
    results = _launch("hang", 1, world=2, bound_s=5 + 0.2 + 5 + 5)
    for rank, (rc, log) in enumerate(results):
        assert rc != 0, log
        assert f"[rank {rank}] cause: rank 0 waited more than collective_timeout_s=5 s in collective #" in log, log
        assert f"[rank {rank}] missing: rank 1" in log
        assert re.search(
            rf"\[rank {rank}\]   rank 1 never reached collective #\d+: it has been running outside any"
            r" collective for [\d.]+ s at \S+test_watchdog.py:\d+ in training_step",
            log,
        ), log
    assert "RankFailure" in results[1][1]  # the hung rank is stopped where it is, with the same report


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step() -> None:
    results = _launch("sigterm", 1, world=2, bound_s=30)
    for rank, (rc, log) in enumerate(results):
        assert rc == 0, log
        assert f"[rank {rank}] stopped in order after step {FAULT_STEP + 1}: rank 1 received SIGTERM." in log, log
        assert "watchdog: ending the run" not in log


# ---- without the Trainer: the guard around a plain loop ----


def plain_loop_raise(fault_rank: int) -> None:
    comm: Comm = init_from_env()
    torch.manual_seed(0)
    model = OddNet()
    sharded = shard_model(model, ShardLabConfig(stage=3), comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard_optimizer(optimizer, sharded)
    with SanityGuard(sharded, [optimizer], SanityConfig(every_n_steps=2, **WATCH)) as guard:
        for step, (x, y) in enumerate(regression_batches(20, 2)):
            guard.before_step(step)
            if step == FAULT_STEP and comm.rank == fault_rank:
                raise RuntimeError("injected failure in a plain loop")
            with sharded.step(keep_root_gathered=True):
                loss = F.mse_loss(model(x), y)
            sharded.prepare_backward(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def test_plain_loop_guard_reports_a_failure_of_the_store_host() -> None:
    results = run_ranks(
        "tests.test_watchdog:plain_loop_raise",
        3,
        {"fault_rank": 0},
        expect_failure=True,
        timeout=STARTUP_S + 0.2 + 5 + 5 + 30,
    )
    assert results[0][0] != 0 and "RuntimeError: injected failure in a plain loop" in results[0][1]
    for rank, (rc, log) in enumerate(results[1:], start=1):
        assert rc != 0, log
        assert f"[rank {rank}] cause: rank 0 failed with RuntimeError: injected failure in a plain loop" in log, log


def test_a_collective_the_device_never_finishes_is_found_without_a_host_wait() -> None:
    """guard/device_queue.py: on a GPU the works of each launched collective are asked (never waited for); the
    oldest one incomplete after the timeout is the hang, and completed ones are let go at once."""
    from lightning_shardlab.comm.call import CollectiveCall
    from lightning_shardlab.guard.device_queue import DeviceQueue

    class Work:  # a stand-in for an NCCL work: complete once its event is
        def __init__(self, done: bool) -> None:
            self.done = done

        def is_completed(self) -> bool:
            return self.done

    queue, finished, never = DeviceQueue(), Work(True), Work(False)
    first = CollectiveCall(0, "all_gather", "blocks.0", 8, "float32")
    second = CollectiveCall(1, "reduce_scatter", "blocks.1", 8, "float32")
    queue.launched(first, [finished], now=0.0)
    queue.launched(second, [never], now=1.0)
    assert len(queue) == 1  # the completed one was let go at the next launch
    assert queue.stuck(now=5.0, timeout_s=10.0) is None
    assert queue.stuck(now=12.0, timeout_s=10.0) is second
    never.done = True
    assert queue.stuck(now=20.0, timeout_s=10.0) is None and len(queue) == 0


def test_a_closed_channels_store_connections_serve_the_next_fits_channels() -> None:
    """Side channels give their connections back when they close, and the next ones (the next fit's) take them
    instead of connecting again; a channel whose thread may still use one keeps it out of the pool."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_shardlab.guard.side_channel import SideChannel

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    first = SideChannel("watchdog", 0, 2, store)
    first.connection()  # the watchdog thread's own
    opened = {id(client) for client in first._clients}
    first.close()
    second = SideChannel("watchdog", 0, 2, store)
    second.connection()
    assert {id(client) for client in second._clients} == opened  # the same two connections: none opened
    assert second.prefix != first.prefix  # a session of its own in the store
    second.store.set("beat", "1")
    assert second.read("beat") == 1
    held = list(second._clients)
    second.close(reuse=False)  # its thread may still hold one: both stay out of the pool
    third = SideChannel("stop", 0, 2, store)
    assert all(third._base is not client for client in held)
    third.close()
