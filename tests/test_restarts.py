"""Restarts (torchrun on localhost, gloo): a rank dies, torchrun starts the job again, and it resumes from its last
complete checkpoint by itself, ending on the weights of Lightning DDP's restart of the same run, bit for bit.

Every job is ``lightning_shardlab.examples.resumable`` (the README's recipe): 3 epochs of 4 steps, ``last.ckpt`` at
each epoch's end; ``--chain`` fits several strategies in the same processes, each hurt the first time it runs, so that
one torchrun launch restarts (and resumes) every stage in turn, each a ``trainer.fit`` after another in the same
processes. DDP's restart is computed in the kept world (the run to epoch 1's checkpoint, then a fresh Trainer
resuming from it), and checked once against a real one: killed, then launched again (``RESUMABLE_LAUNCH=1``; a
fresh launch, since under torchrun torch's own process group meets the dead attempt's keys in the agent's store,
which is what shardlab's groups avoid: comm/store.py). That launch and the SIGTERM test's are one chain launched
four times (``--die-at-step`` and ``--die-how`` per entry): each launch resumes one entry and hurts the next. The
tests of the three stages and of ``async_save`` share one launch (4 restarts) the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import ROOT, free_port, run_ranks

DIE_AT = 5  # once optimizer step 5 is done: mid-epoch 2, the last complete checkpoint is epoch 1's (step 4)


def torchrun(out: Path, *job: str, ranks: int = 2, restarts: int = 0, launch: int = 0, ok: bool = True) -> str:
    """Run the resumable job under torchrun; its output (asserting it ended as ``ok`` says)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts),
        "--monitor-interval", "0.2", "-m", "lightning_shardlab.examples.resumable", "--out", str(out), *job,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "RESUMABLE_LAUNCH": str(launch),
    }
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, f"exit {done.returncode}:\n{output[-6000:]}"
    return output


def diary(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name / "attempts.jsonl").read_text().splitlines()]


def final(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / name / "final.pt")


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    differ = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not differ, f"{what}: {differ}"


def rank_order_ddp_2x2() -> Any:
    """The hybrid layout's DDP reference: gradients averaged in shardlab's order (2 groups of 2)."""
    from tests.helpers.reference import RankOrderDDP

    return RankOrderDDP(shard_group_size=2)


def restart_in_process(out: str, spec: str, devices: int) -> dict[str, torch.Tensor] | None:
    """What DDP's restart after a kill at step 5 computes, in the kept world (no torchrun launch): the run stopped
    at the same point on every rank (``--die-how raise``: its files are what the killed attempt leaves), then a
    fresh Trainer resuming from its last checkpoint."""
    import argparse

    import torch.distributed as dist

    from lightning_shardlab.examples.resumable import Stopped, fit_one

    args = argparse.Namespace(
        out=out, devices=devices, steps_per_epoch=4, die_at_step=DIE_AT, die_how="raise", async_save=False,
        shard_group_size=None, epochs=3,
    )  # fmt: skip
    with pytest.raises(Stopped):
        fit_one(spec, args)
    dist.barrier()
    fit_one(spec, args)  # hurt once: this one resumes
    dist.barrier()
    return final(Path(out), spec.replace(":", "-")) if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def ddp_restarted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ddp")
    (weights, _) = run_ranks(
        "tests.test_restarts:restart_in_process", 2, {"out": str(out), "spec": "ddp", "devices": 2}
    )
    events = [(e["event"], e["step"]) for e in diary(out, "ddp")]
    assert events == [("start", 0), ("hurt (raise)", DIE_AT), ("start", 4)], events  # resumed from epoch 1's
    return weights


SIGTERM_AT = {"shardlab_stage_2": DIE_AT, "ddp@sigterm": DIE_AT + 1}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[set[str]]]:
    """One chain, launched again until it is done (4 launches): ``ddp`` killed at step 5 (rank 1 exits: the launch
    fails), then each of ``ddp@sigterm`` and ``shardlab_stage_2`` sent SIGTERM (at steps 6 and 5: each such launch
    exits 0). Each launch resumes the entry the last one hurt and hurts the next; DDP never runs after shardlab in
    the same processes. Also which entries had final weights after each launch."""
    out = tmp_path_factory.mktemp("launches")
    chain = ("ddp", "ddp@sigterm", "shardlab_stage_2")
    steps, hows = (DIE_AT, SIGTERM_AT["ddp@sigterm"], SIGTERM_AT["shardlab_stage_2"]), ("exit", "sigterm", "sigterm")
    job = ("--chain", ",".join(chain), "--die-at-step", ",".join(map(str, steps)), "--die-how", ",".join(hows))
    done = []
    for launch in range(len(chain) + 1):
        torchrun(out, *job, launch=launch, ok=launch > 0)
        done.append({name for name in chain if (out / name / "final.pt").exists()})
    return out, done


def test_ddp_restarted_in_process_is_ddp_restarted_by_a_launch(
    launches: tuple[Path, list[set[str]]], ddp_restarted: dict[str, torch.Tensor]
) -> None:
    """The reference above is what a real restart of DDP computes: killed at step 5, launched again."""
    out, done = launches
    assert "ddp" not in done[0] and "ddp" in done[1], done
    assert [(e["attempt"], e["event"], e["step"]) for e in diary(out, "ddp")] == [
        (0, "start", 0), (0, "hurt (exit)", DIE_AT), (1, "start", 4)
    ]  # fmt: skip
    assert_same_weights(final(out, "ddp"), ddp_restarted, "DDP restarted by a launch")


STAGES = ["shardlab_stage_1", "shardlab_stage_2", "shardlab"]
ASYNC = "shardlab@async"  # stage 3 again, with async_save, in its own directory


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun launch with 4 restarts of the chain: stages 1, 2, 3 (rank 1 dies after step 5 of each), then
    stage 3 with ``async_save`` (rank 1 dies after step 8)."""
    out = tmp_path_factory.mktemp("restarted")
    chain = [*STAGES, ASYNC]
    steps, saves = [DIE_AT] * len(STAGES) + [8], ["0"] * len(STAGES) + ["1"]
    job = ("--chain", ",".join(chain), "--die-at-step", ",".join(map(str, steps)), "--async-save", ",".join(saves))
    torchrun(out, *job, restarts=len(chain))
    return out


def test_a_killed_rank_restarted_by_torchrun_resumes_at_every_stage(
    restarted: Path, ddp_restarted: dict[str, torch.Tensor]
) -> None:
    """Stages 1, 2, 3 in one torchrun launch with restarts: each attempt loses rank 1 at step 5 of one stage; the
    next resumes it from step 4 (and opens the next stage's groups in the same processes)."""
    for k, name in enumerate(STAGES):
        events = diary(restarted, name)
        assert [(e["attempt"], e["event"], e["step"]) for e in events] == [
            (k, "start", 0), (k, "hurt (exit)", DIE_AT), (k + 1, "start", 4)
        ], events  # fmt: skip
        assert_same_weights(final(restarted, name), ddp_restarted, name)


def test_a_killed_rank_during_an_async_save_resumes_from_the_last_complete_checkpoint(
    restarted: Path, ddp_restarted: dict[str, torch.Tensor]
) -> None:
    """Stage 3 with ``async_save`` (the chain's last entry): rank 1 dies just after step 8, while epoch 2's
    ``last.ckpt`` is still in flight (not complete); the restart resumes from the last complete one, epoch 1's
    (step 4)."""
    events = diary(restarted, ASYNC)
    k = len(STAGES)
    assert [(e["attempt"], e["event"], e["step"]) for e in events] == [
        (k, "start", 0), (k, "hurt (exit)", 8), (k + 1, "start", 4)
    ], events  # fmt: skip
    assert events[1]["save_in_flight"], events
    assert_same_weights(final(restarted, ASYNC), ddp_restarted, "async")


def test_hybrid_2x2_restarted_by_torchrun_resumes(tmp_path: Path) -> None:
    """4 ranks, 2 shard groups of 2 (stage 3): rank 1 dies at step 5, torchrun restarts the job, it resumes."""
    spec = "tests.test_restarts:rank_order_ddp_2x2"
    kwargs = {"out": str(tmp_path / "ddp"), "spec": spec, "devices": 4}
    reference = run_ranks("tests.test_restarts:restart_in_process", 4, kwargs)[0]
    job = ("--chain", "shardlab", "--shard-group-size", "2", "--die-at-step", str(DIE_AT))
    torchrun(tmp_path / "hybrid", *job, ranks=4, restarts=1)
    events = diary(tmp_path / "hybrid", "shardlab")
    assert [(e["attempt"], e["step"]) for e in events] == [(0, 0), (0, DIE_AT), (1, 4)], events
    assert_same_weights(final(tmp_path / "hybrid", "shardlab"), reference, "hybrid 2x2")


def test_sigterm_to_every_rank_stops_with_a_checkpoint_and_a_fresh_launch_resumes(
    launches: tuple[Path, list[set[str]]],
) -> None:
    """SIGTERM to every rank as step 6 begins (what a preempting scheduler sends): every rank stops after the same
    step, the one after it (guard/orderly_stop.py: agreed through the store, no collective per step), ``last.ckpt`` is
    written first and the job exits (0: Lightning's ``SIGTERMException`` is a ``SystemExit``); launched again, it
    resumes from step 7. DDP, signalled as step 7 begins, stops after it (Lightning's own handling) and resumes the
    same way: a mid-epoch resume replays what Lightning replays, so both stop after the same step to be one run.
    (Launches 1 to 3 of the chain above: each signalled in one launch, resumed by the next.)"""
    out, done = launches
    for k, name in enumerate(("ddp@sigterm", "shardlab_stage_2"), start=1):
        assert name not in done[k] and name in done[k + 1], (name, done)  # stopped by SIGTERM: no final weights
        events = diary(out, name)
        assert [(e["attempt"], e["event"], e["step"]) for e in events] == [
            (k, "start", 0), (k, "hurt (sigterm)", SIGTERM_AT[name]), (k + 1, "start", DIE_AT + 2)
        ], events  # fmt: skip
    assert_same_weights(final(out, "shardlab_stage_2"), final(out, "ddp@sigterm"), "after SIGTERM")


def fit_twice_reopening_the_group(out: str) -> list[int]:
    """Two fits in one process, the process group destroyed before each: the second opens its groups on the same
    address, whose store (hosted by rank 0, multi-tenant) still holds the first one's keys."""
    import lightning as L
    import torch.distributed as dist

    from lightning_shardlab import ShardLabStrategy
    from lightning_shardlab.examples.resumable import Block, Regressor, data

    steps = []
    for k in range(2):
        if dist.is_initialized():
            dist.destroy_process_group()
        strategy = ShardLabStrategy(stage=3, unit_classes=[Block], shard_group_size=1)  # a mesh: groups of its own
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=2, default_root_dir=f"{out}/{k}",
            enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Regressor(), data(2, 2))
        steps.append(trainer.global_step)
    return steps


def test_fit_twice_in_one_process_with_the_group_opened_again(tmp_path: Path) -> None:
    """The store keys of a process group opened again never meet the first opening's (comm/store.py)."""
    assert run_ranks("tests.test_restarts:fit_twice_reopening_the_group", 2, {"out": str(tmp_path)}) == [[2, 2]] * 2
