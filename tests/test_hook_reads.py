"""A DDP user's hooks read gradients and weights: the same script under Lightning's ``ddp`` and shardlab, stages 1-3.

One module records what its hooks read (sharding/shard_reads.py serves each read from the shards): the weights'
norms in ``on_train_batch_start``, a weight's clone compared after the step and a hand EMA (``lerp_`` into a local
copy) in ``on_train_batch_end``, a norm summed in ``on_train_epoch_end``, ``p.grad.abs().max()`` in
``on_after_backward``, Lightning's ``grad_norm`` (every key), a NaN check, a hand ``clip_grad_norm_`` and a scaled
gradient (``mul_``) in ``on_before_optimizer_step``; a manually optimised twin clones ``p.grad`` after
``manual_backward``; Fabric reads ``p.grad`` after ``fabric.backward``. Every value equals DDP's (fp32 tolerances),
and so do the final weights, which the in-place edits changed. A read one rank makes alone ends with a clear error on
every rank, in bounded time, mid-run and at the very end of fit. Two ranks for all of it; three for stage 3 (pieces of
uneven length, some empty, and padding).
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections import defaultdict
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import Tensor
from torch.testing import assert_close

from lightning_shardlab import ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.comm.mismatch import CollectiveMismatch
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, init_from_env
from tests.models import OddNet, OrderedData, regression_batches, regression_dataset

STEPS, BATCH = 3, 2
QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
}


class HookReads(L.LightningModule):
    """Reads gradients and weights in Lightning's hooks, as a DDP user would; ``lone_read_at``: on that batch, rank
    0 alone reads the norm of a weight (or of its gradient: ``lone_read="gradient"``), ``if self.global_rank == 0``."""

    def __init__(self, manual: bool = False, lone_read_at: int | None = None, lone_read: str = "weight") -> None:
        super().__init__()
        self.net = OddNet()
        self.automatic_optimization = not manual
        self.lone_read_at, self.lone_read = lone_read_at, lone_read
        self.rec: dict[str, list[Any]] = defaultdict(list)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.rec["manual_grads"].append({n: p.grad.clone() for n, p in self.net.named_parameters()})
            self.rec["manual_clip"].append(torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05).detach())
            optimizer.step()
        return loss

    def on_train_start(self) -> None:
        with torch.no_grad():
            self.ema = {n: p.detach().clone() for n, p in self.net.named_parameters()}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before = self.net.inp.weight.clone()
        self.rec["weight_norms"].append(torch.stack([p.norm() for p in self.parameters()]).detach())

    def on_after_backward(self) -> None:
        self.rec["abs_max"].append(torch.stack([p.grad.abs().max() for p in self.parameters() if p.grad is not None]))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.rec["grad_norm"].append({k: v.detach().clone() for k, v in grad_norm(self, norm_type=2).items()})
        self.rec["finite"].append(
            all(bool(torch.isfinite(p.grad).all()) for p in self.parameters() if p.grad is not None)
        )
        if self.automatic_optimization:
            self.rec["hand_clip"].append(torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05).detach())
            self.net.out.bias.grad.mul_(0.5)
            self.rec["after_edits"].append(grad_norm(self, norm_type=2)["grad_2.0_norm_total"].detach().clone())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rec["moved"].append((self.net.inp.weight.clone() - self.before).norm().detach())
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                self.ema[n].lerp_(p, 0.5)
        if batch_idx == self.lone_read_at and self.global_rank == 0:
            (self.net.inp.weight if self.lone_read == "weight" else self.net.inp.weight.grad).norm()

    def on_train_epoch_end(self) -> None:
        if self.lone_read_at is not None and self.lone_read_at >= STEPS - 1:
            return  # nothing the peers read after the lone read: fit's last call must meet it
        self.rec["epoch_sum"].append(sum(p.sum() for p in self.parameters()).detach())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _fit(model: HookReads, strategy: Any, world: int, steps: int = STEPS) -> L.Trainer:
    trainer = L.Trainer(devices=world, strategy=strategy, max_steps=steps, max_epochs=1, **QUIET)
    trainer.fit(model, OrderedData(regression_dataset(steps * BATCH * world), BATCH))
    return trainer


def _records(model: HookReads, trainer: L.Trainer) -> dict[str, Any]:
    strategy = trainer.strategy
    state = strategy.full_state_dict() if isinstance(strategy, ShardLabStrategy) else model.state_dict()
    return {**model.rec, "ema": model.ema, "state": {k: v.detach().cpu() for k, v in state.items()}}


def _fabric_grads(world: int, stage: int | None) -> list[dict[str, Tensor]]:
    """Fabric's p.grad after ``fabric.backward`` (and a hand clip), each step."""
    strategy = "ddp" if stage is None else shardlab_fabric.ShardLabStrategy(stage=stage)
    fabric = L.Fabric(devices=world, strategy=strategy, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(0)
    model = OddNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = regression_dataset(STEPS * BATCH * world)
    out = []
    for step in range(STEPS):
        rows = [(step * world + fabric.global_rank) * BATCH + i for i in range(BATCH)]
        x, y = data[rows]
        fabric.backward(F.mse_loss(model(x), y))
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}  # DDP's wrapper adds a prefix
        grads["clip"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).detach()
        out.append(grads)
        optimizer.step()
        optimizer.zero_grad()
    return out


class AccumulationReads(HookReads):
    """Reads every parameter's whole gradient after each micro-batch's backward, under accumulation of 2."""

    def on_after_backward(self) -> None:
        self.rec["micro"].append({n: p.grad.clone() for n, p in self.net.named_parameters()})

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass


def accumulation_reads(world: int) -> dict[str, Any]:
    """``p.grad`` after each micro-batch of an accumulation of 2: DDP, shardlab's default (reduced as it goes) at
    stages 1 and 3, and ``accumulation='defer'``; the warnings each said."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    initial = AccumulationReads()
    cases = [("ddp", "ddp"), *((f"stage {s}", ShardLabStrategy(stage=s)) for s in (1, 3))]
    cases.append(("defer", ShardLabStrategy(stage=3, accumulation="defer")))
    for label, strategy in cases:
        model = copy.deepcopy(initial)
        trainer = L.Trainer(
            devices=world, strategy=strategy, max_steps=2, accumulate_grad_batches=2, max_epochs=1, **QUIET
        )
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer.fit(model, OrderedData(regression_dataset(4 * BATCH * world), BATCH))
        out[label] = {
            "micro": model.rec["micro"],
            "said": [str(w.message) for w in said if "micro-batch" in str(w.message)],
        }
    return out


def hook_reads(stages: list[int], fabric: bool = True) -> dict[str, Any]:
    """Every case on this rank: the DDP reference, then shardlab at ``stages``; automatic and manual; Fabric."""
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    for manual in (False, True):
        torch.manual_seed(0)
        initial = HookReads(manual=manual)
        for label, strategy in [("ddp", "ddp"), *((f"stage {s}", ShardLabStrategy(stage=s)) for s in stages)]:
            model = copy.deepcopy(initial)
            trainer = _fit(model, strategy, world)
            out[f"{'manual' if manual else 'automatic'} {label}"] = _records(model, trainer)
    if fabric:
        for stage in (None, *stages):
            out[f"fabric {'ddp' if stage is None else f'stage {stage}'}"] = _fabric_grads(world, stage)
        out["accumulation"] = accumulation_reads(world)
    return out


def lone_reads(cases: list[dict]) -> list[dict[str, Any]]:
    """Rank 0 alone reads a weight's norm in ``on_train_batch_end``: each case's error on this rank, and how long the
    fit took to end."""
    world = int(os.environ["WORLD_SIZE"])
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = HookReads(lone_read_at=case["at"], lone_read=case["read"])
        strategy = ShardLabStrategy(stage=case["stage"], sanity_every_n_steps=case.get("every", 10))
        started = time.perf_counter()
        try:
            _fit(model, strategy, world)
            error: Exception | None = None
        except CollectiveMismatch as caught:
            error = caught
        out.append(
            {
                "error": type(error).__name__ if error else None,
                "message": str(error) if error else "",
                "seconds": time.perf_counter() - started,
            }
        )
    return out


def engine_edits(stage: int) -> dict[str, Any]:
    """A plain loop on the engine beside an unsharded reference on the global batch: what a user does to ``.grad``
    and (stage 3) to a weight at rest reaches the shards; outside the read window a read is refused."""
    comm = init_from_env()
    torch.manual_seed(0)
    model, reference = OddNet(), OddNet()
    reference.load_state_dict(model.state_dict())
    sharded = shard_model(model, ShardLabConfig(stage=stage), comm)
    sharded.reads.open()
    optimizer, ref_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), 0.1)
    shard_optimizer(optimizer, sharded)
    ((x, y),) = regression_batches(1, 2 * comm.world_size)
    mine = slice(2 * comm.rank, 2 * comm.rank + 2)

    def backward() -> None:
        loss = F.mse_loss(model(x[mine]), y[mine])
        sharded.prepare_backward(loss)
        loss.backward()
        F.mse_loss(reference(x), y).backward()

    out: dict[str, Any] = {}
    backward()
    model.zero_grad()  # set to None: the optimizer must skip every parameter, as DDP's does
    reference.zero_grad()
    out["grad_none"] = all(p.grad is None for p in model.parameters())
    optimizer.step()
    ref_optimizer.step()
    out["unchanged"] = [(p.clone(), q.detach().clone()) for p, q in zip(model.parameters(), reference.parameters())]
    backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = p.grad * 0.5  # a new .grad: its values are kept, and the next backward adds to them
        q.grad = q.grad * 0.5
    backward()
    out["accumulated"] = [(p.grad.clone(), q.grad.clone()) for p, q in zip(model.parameters(), reference.parameters())]
    optimizer.zero_grad(set_to_none=False)
    ref_optimizer.zero_grad(set_to_none=False)
    out["zeroed"] = [float(p.grad.abs().max()) for p in model.parameters()]
    backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        for g in (p.grad, q.grad):
            g[0] = 0.25  # through the whole value, back to the shard
            g.clamp_(-0.2, 0.2)
    with torch.no_grad():
        model.blocks[0].l1.weight.mul_(0.5)  # at stage 3 a weight at rest: its master and compute shards
        reference.blocks[0].l1.weight.mul_(0.5)
    optimizer.step()
    ref_optimizer.step()
    out["stepped"] = [(p.clone(), q.detach().clone()) for p, q in zip(model.parameters(), reference.parameters())]
    with torch.no_grad():  # (without gradients every unit is let go after its forward: at rest again at stage 3)
        out["next_loss"] = (F.mse_loss(model(x), y), F.mse_loss(reference(x), y))
    held = model.inp.weight.grad
    sharded.reads.close(last_call=True)
    out["grad_after"] = [p.grad for p in model.parameters()]  # None: nothing may read them without the peers
    out["refused"] = []
    for read in (held.norm, model.inp.weight.norm):
        try:
            read()
            out["refused"].append("")
        except RuntimeError as error:
            out["refused"].append(str(error))
    return out


def _same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            _same(got[key], want[key], f"{where} {key}")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{where}: {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, Tensor):
        assert type(got) is Tensor, f"{where}: a {type(got).__name__}, not a plain tensor"
        assert_close(got, want, **FP32, msg=lambda m: f"{where}\n{m}")
    else:
        assert got == want, f"{where}: {got} != {want}"


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks("tests.test_hook_reads:hook_reads", 2, {"stages": [1, 2, 3]}, timeout=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_hooks_read_what_ddp_reads(two_ranks: list[dict[str, Any]], mode: str, stage: int) -> None:
    for rank, report in enumerate(two_ranks):
        want, got = report[f"{mode} ddp"], report[f"{mode} stage {stage}"]
        assert set(got) == set(want), (sorted(got), sorted(want))
        assert all("grad_2.0_norm_total" in norms and len(norms) > 2 for norms in want["grad_norm"]), want["grad_norm"]
        for key in want:
            if key != "state" or rank == 0:
                _same(got[key], want[key], f"{mode}, stage {stage}, rank {rank}: {key}")
        assert all(want["finite"]) and len(want["moved"]) == STEPS


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fabric_sees_the_gradient_after_backward(two_ranks: list[dict[str, Any]], stage: int) -> None:
    for rank, report in enumerate(two_ranks):
        _same(report[f"fabric stage {stage}"], report["fabric ddp"], f"Fabric, stage {stage}, rank {rank}")


def test_a_gradient_read_during_accumulation_is_the_average_so_far_and_says_so(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Before the last micro-batch DDP shows each rank its own sum (its all-reduce waits); shardlab, reducing as it
    goes, shows the ranks' average of those sums and says so once (rank 0); from the last micro-batch on, DDP's
    values; ``accumulation='defer'`` shows DDP's own on every micro-batch, silently."""
    runs = [report["accumulation"] for report in two_ranks]
    for rank, run in enumerate(runs):
        ddp = run["ddp"]["micro"]
        assert len(ddp) == 4, len(ddp)  # 2 optimizer steps of 2 micro-batches
        for label in ("stage 1", "stage 3"):
            got = run[label]["micro"]
            for i in (0, 2):  # before each step's last micro-batch: the mean of the ranks' own sums
                mean = {n: sum(r["ddp"]["micro"][i][n] for r in runs) / len(runs) for n in ddp[i]}
                _same(got[i], mean, f"{label}, rank {rank}, micro-batch {i}")
            for i in (1, 3):
                _same(got[i], ddp[i], f"{label}, rank {rank}, micro-batch {i}")
            assert len(run[label]["said"]) == (1 if rank == 0 else 0), run[label]["said"]
            assert rank != 0 or "accumulation='defer'" in run[label]["said"][0]
        _same(run["defer"]["micro"], ddp, f"defer, rank {rank}")
        assert run["defer"]["said"] == []
    assert not torch.equal(runs[0]["ddp"]["micro"][0]["inp.weight"], runs[1]["ddp"]["micro"][0]["inp.weight"])


def test_three_ranks_read_uneven_pieces_at_stage_3() -> None:
    reports = run_ranks("tests.test_hook_reads:hook_reads", 3, {"stages": [3], "fabric": False}, timeout=300)
    for rank, report in enumerate(reports):
        for mode in ("automatic", "manual"):
            want, got = report[f"{mode} ddp"], report[f"{mode} stage 3"]
            for key in want:
                if key != "state" or rank == 0:
                    _same(got[key], want[key], f"3 ranks, {mode}, rank {rank}: {key}")


@pytest.mark.parametrize("stage", [1, 3])
def test_what_a_user_does_to_grad_and_weights_reaches_the_shards(stage: int) -> None:
    """``module.zero_grad()`` (set to None), ``p.grad = p.grad * 0.5`` then another backward, ``zero_grad(set_to_none=
    False)``, ``g[0] = v`` and ``clamp_`` on gradients, ``mul_`` on a weight: as on the unsharded reference."""
    for rank, out in enumerate(run_ranks("tests.test_hook_reads:engine_edits", 2, {"stage": stage}, timeout=60)):
        where = f"stage {stage}, rank {rank}"
        assert out["grad_none"], where
        for key in ("unchanged", "accumulated", "stepped"):
            for i, (got, want) in enumerate(out[key]):
                assert_close(got, want, **FP32, msg=lambda m, k=key, i=i: f"{where}: {k}[{i}]\n{m}")
        assert out["zeroed"] == [0.0] * len(out["zeroed"]), where
        assert_close(*out["next_loss"], **FP32)
        assert out["grad_after"] == [None] * len(out["grad_after"]), where
        held, weight = out["refused"]
        assert held.startswith(f"[rank {rank}] the gradient of 'inp.weight' was read (norm) outside training"), where
        assert "HINT" in held, where
        if stage == 3:  # a weight at rest, outside fit
            assert weight.startswith(f"[rank {rank}] parameter 'inp.weight' was read (norm)") and "HINT" in weight
        else:  # stages 1-2: the module's own tensor
            assert weight == "", where


def test_a_read_on_one_rank_ends_the_run_on_every_rank() -> None:
    """Mid-run (the next step's collectives meet it) and on the last batch with no sanity checks left (the
    strategy's last call of fit meets it): the same error on every rank, naming the read, well before any timeout."""
    cases = [
        {"stage": 3, "at": 1, "read": "weight"},
        {"stage": 3, "at": STEPS - 1, "read": "weight", "every": 0},
        {"stage": 1, "at": STEPS - 1, "read": "gradient", "every": 0},
    ]
    reports = run_ranks("tests.test_hook_reads:lone_reads", 2, {"cases": cases}, timeout=120)
    for case_index, case in enumerate(cases):
        for rank, report in enumerate(r[case_index] for r in reports):
            where = f"{case}, rank {rank}"
            assert report["error"] == "CollectiveMismatch", (where, report)
            message = report["message"]
            assert message.startswith(f"[rank {rank}] collective #"), (where, message)
            assert f"rank 0 issued 'read {case['read']} net.inp.weight (norm 2)'" in message, (where, message)
            assert "a read on some ranks only" in message and "HINT" in message, (where, message)
            assert report["seconds"] < 60, (where, report["seconds"])
            if case["at"] == STEPS - 1:  # the peers were leaving fit: the strategy's last call of fit met the read
                assert "barrier 'end of hook reads'" in message, (where, message)
