"""Fabric's front door against Fabric's own DDP, on the same data, at every stage.

Each run trains the same initial model with ``Fabric(strategy="ddp")`` (the reference) and with shardlab in
the same ranks: gradient accumulation under ``no_backward_sync`` (both accumulation modes), clipping by the
global norm, an LR schedule, and a sharded save after step 3 from which a fresh model, optimizer and schedule
load and train on. Every rank compares its loss at every micro-batch and the clipped norm at every step;
rank 0 compares the final weights (DDP's module state against ``full_state_dict()``). fp32 tolerance.

Whole-tensor optimizers (torch's Muon on the blocks' matrices with AdamW on the rest, and Adafactor) train the
same way at stages 1 and 3, resumed from a checkpoint that holds their state, and their final weights must equal
DDP's bit for bit: Muon orthogonalises in bfloat16, where a last-bit difference of a gradient can become a whole
bfloat16 step. So their gradients must be DDP's exactly: at 2 ranks DDP's mean is shardlab's (each sum has two
terms), micro-batches accumulate before the reduction (``accumulation="defer"``, as DDP does), and the clipping
threshold lies above every norm (the norm is still compared; the coefficient is exactly 1 in both runs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from lightning_shardlab import fabric as shardlab_fabric
from lightning_shardlab.checkpoint.consolidate import consolidated_checkpoint
from lightning_shardlab.checkpoint.describe import describe
from lightning_shardlab.checkpoint.fabric_state import full_parts
from lightning_shardlab.checkpoint.format import shards_of
from tests.helpers.cli_tools import every_tool
from tests.helpers.launch import run_commands, run_ranks
from tests.helpers.reference import FP32
from tests.models import TinyGPT, token_dataset

STEPS, MICRO, LOCAL = 6, 2, 2  # optimizer steps, micro-batches per step, sequences per rank per micro-batch
SAVE_AFTER = 3
QUIET = {"accelerator": "cpu"}


def _batches(world: int, rank: int) -> list[list[tuple[Tensor, Tensor]]]:
    """Step s, micro-batch m: this rank's rows of the global micro-batch (rank r takes rows r, r + N, ...)."""
    data = token_dataset(STEPS * MICRO * LOCAL * world)
    x, y = data.tensors
    per = LOCAL * world
    out = []
    for s in range(STEPS):
        micro = []
        for m in range(MICRO):
            lo = (s * MICRO + m) * per
            micro.append((x[lo : lo + per][rank::world], y[lo : lo + per][rank::world]))
        out.append(micro)
    return out


WHOLE_TENSOR = ("muon", "adafactor")  # kinds whose optimizers step whole parameters on owner ranks


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "litgpt":  # a third party's model, unchanged: litgpt's GPT (its blocks in transformer.h)
        from litgpt import GPT, Config

        config = Config(n_layer=2, n_embd=24, n_head=4, vocab_size=37, padded_vocab_size=40, block_size=11, bias=False)
        return GPT(config)  # no biases: a key bias gets an exactly-zero gradient whose noise Adam amplifies
    return TinyGPT(n_layer=2)


def _optimizers(model: nn.Module, kind: str) -> dict[str, torch.optim.Optimizer]:
    """By the key each is saved under: AdamW; or the usual Muon recipe (Muon on the blocks' matrices, AdamW on
    the embeddings and norms); or Adafactor alone."""
    if kind == "muon":
        named = list(model.named_parameters())
        matrix = {n for n, p in named if "blocks" in n.split(".") and p.ndim == 2}
        return {
            "muon": torch.optim.Muon([p for n, p in named if n in matrix], lr=0.02, weight_decay=0.1, momentum=0.95),
            "adamw": torch.optim.AdamW([p for n, p in named if n not in matrix], lr=3e-3, weight_decay=0.0),
        }
    if kind == "adafactor":
        return {"adafactor": torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)}
    return {"optimizer": torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)}


def _schedules(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, object]:
    return {
        f"{key}_schedule": torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / 3))
        for key, o in optimizers.items()
    }


def _objects(fabric: L.Fabric, stage: int, kind: str) -> tuple[nn.Module, dict, dict]:
    """Stages 1-2: Fabric's usual order (module, then optimizers over its parameters); stage 3: together
    (Fabric refuses optimizers over the meta placeholders a stage-3 module holds between steps)."""
    model = _model(kind)
    if stage == 3:
        optimizers = _optimizers(model, kind)
        model, *stepping = fabric.setup(model, *optimizers.values())
    else:
        model = fabric.setup_module(model)
        optimizers = _optimizers(model, kind)
        stepping = fabric.setup_optimizers(*optimizers.values())
        stepping = stepping if isinstance(stepping, (list, tuple)) else [stepping]
    optimizers = dict(zip(optimizers, stepping))
    return model, optimizers, _schedules(optimizers)


def _train(fabric, model, optimizers, schedules, batches, steps: range, kind: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"losses": [], "norms": []}
    max_norm = 1e3 if kind in WHOLE_TENSOR else 0.05
    for step in steps:
        for m, (idx, targets) in enumerate(batches[step]):
            with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                logits = model(idx)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) / MICRO
                fabric.backward(loss)
            out["losses"].append(loss.item())
        for optimizer in optimizers.values():
            out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=max_norm)))
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        for schedule in schedules.values():
            schedule.step()
    return out


def _ddp_run(world: int, rank: int, kind: str) -> tuple[dict[str, list[float]], dict[str, Tensor]]:
    fabric = L.Fabric(devices=world, strategy="ddp", **QUIET)
    fabric.launch()
    model = _model(kind)
    optimizers = _optimizers(model, kind)
    model, *stepping = fabric.setup(model, *optimizers.values())
    optimizers = dict(zip(optimizers, stepping))
    record = _train(fabric, model, optimizers, _schedules(optimizers), _batches(world, rank), range(STEPS), kind)
    return record, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _shardlab_run(world: int, rank: int, stage: int, accumulation: str, directory: str, kind: str) -> dict:
    strategy = shardlab_fabric.ShardLabStrategy(stage=stage, accumulation=accumulation)
    fabric = L.Fabric(devices=world, strategy=strategy, **QUIET)
    fabric.launch()
    batches = _batches(world, rank)
    model, optimizers, schedules = _objects(fabric, stage, kind)
    first = _train(fabric, model, optimizers, schedules, batches, range(SAVE_AFTER), kind)
    path = Path(directory) / f"stage{stage}"
    fabric.save(path, {"model": model, **optimizers, **schedules, "step": SAVE_AFTER})
    saved = fabric.strategy.full_state_dict(model)
    # a fresh run resumes from the checkpoint: different initial weights, the same numbers from here on
    torch.manual_seed(123)
    model, optimizers, schedules = _objects(fabric, stage, kind)
    state = {"model": model, **optimizers, **schedules, "step": 0}
    remainder = fabric.load(path, state)
    rest = _train(fabric, model, optimizers, schedules, batches, range(state["step"], STEPS), kind)
    return {
        "losses": first["losses"] + rest["losses"],
        "norms": first["norms"] + rest["norms"],
        "remainder": remainder,
        "weights": fabric.strategy.full_state_dict(model),
        "saved": saved,
        "collectives": _collectives(fabric),
    }


def _collectives(fabric: L.Fabric) -> dict:
    rank = fabric.global_rank
    total = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    mean = fabric.all_reduce(torch.tensor(float(rank + 1)))
    fabric.barrier()
    return {"sum": float(total), "mean": float(mean), "broadcast": fabric.broadcast(f"from {rank}", src=0)}


def fabric_parity(stages: list[int], accumulation: list[str], directory: str, kind: str = "tiny_gpt") -> dict:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    reference, weights = _ddp_run(world, rank, kind)
    out = {}
    for stage, mode in zip(stages, accumulation):
        run = _shardlab_run(world, rank, stage, mode, directory, kind)
        assert run["remainder"] == {}, run["remainder"]
        assert_close(run["losses"], reference["losses"], **FP32, msg=lambda m: f"{kind} stage {stage} losses: {m}")
        assert_close(run["norms"], reference["norms"], **FP32, msg=lambda m: f"{kind} stage {stage} clipped norms: {m}")
        if rank == 0:
            assert run["weights"].keys() == weights.keys()
            for name, value in weights.items():
                assert_close(run["weights"][name], value, **FP32, msg=lambda m: f"{kind} stage {stage} {name}: {m}")
                assert kind not in WHOLE_TENSOR or torch.equal(run["weights"][name], value), (
                    f"{kind} stage {stage} {name}"
                )
        out[stage] = {"norms": run["norms"], "collectives": run["collectives"], "saved": run["saved"]}
    return out


def fabric_parities(cases: list[dict], directory: str) -> dict:
    """Several ``fabric_parity`` cases in one launch, by kind, each saving under a folder of its own."""
    return {case["kind"]: fabric_parity(**case, directory=str(Path(directory) / case["kind"])) for case in cases}


@pytest.mark.parametrize("world", [2, 4])
def test_fabric_matches_fabric_ddp_at_every_stage(world: int, tmp_path: Path) -> None:
    """Stages 1-3, both accumulation modes, clipping, an LR schedule, a sharded save + load after step 3."""
    modes = ["reduce", "defer", "reduce"] if world == 2 else ["defer", "reduce", "defer"]
    ranks = run_ranks(
        "tests.test_fabric:fabric_parity",
        world,
        {"stages": [1, 2, 3], "accumulation": modes, "directory": str(tmp_path)},
        timeout=420,
    )
    for report in ranks:
        for stage in (1, 2, 3):
            assert max(report[stage]["norms"]) > 0.05  # clipping clipped
            assert report[stage]["collectives"] == {
                "sum": world * (world + 1) / 2,
                "mean": (world + 1) / 2,
                "broadcast": "from 0",
            }
    # the sharded checkpoint consolidates into Fabric's full shape, equal to the live weights at save time
    full = consolidated_checkpoint(tmp_path / "stage3")
    assert set(full) == {"model", "optimizer", "optimizer_schedule", "step"} and full["step"] == SAVE_AFTER
    for name, value in ranks[0][3]["saved"].items():
        assert torch.equal(full["model"][name], value), name


def test_litgpt_and_whole_tensor_optimizers_train_like_fabric_ddp(tmp_path: Path) -> None:
    """litgpt's GPT at stage 3 (its blocks become units) and stage 2; Muon with AdamW, and Adafactor, at stages 1
    and 3 (their state saved and loaded mid-run; the final weights bit for bit): against Fabric's DDP."""
    whole = {"stages": [1, 3], "accumulation": ["defer", "defer"]}
    cases = [
        {"kind": "litgpt", "stages": [3, 2], "accumulation": ["reduce", "defer"]},
        {"kind": "muon", **whole},
        {"kind": "adafactor", **whole},
    ]
    ranks = run_ranks("tests.test_fabric:fabric_parities", 2, {"cases": cases, "directory": str(tmp_path)}, timeout=420)
    assert all(max(r["litgpt"][3]["norms"]) > 0.05 for r in ranks)
    for kind in WHOLE_TENSOR:  # the checkpoint holds each optimizer's state, the whole-tensor one's included
        full = consolidated_checkpoint(tmp_path / kind / "stage3")
        keys = {"muon": ["muon", "adamw"], "adafactor": ["adafactor"]}[kind]
        assert set(full) == {"model", "step", *keys, *(f"{k}_schedule" for k in keys)}, (kind, set(full))
        for key in keys:  # state for every parameter of each optimizer's groups
            params = [i for group in full[key]["param_groups"] for i in group["params"]]
            assert sorted(full[key]["state"]) == sorted(params), (kind, key)


# ---- checkpoints across world sizes, stages and front doors ----


def _fabric(world: int, **options: object) -> L.Fabric:
    fabric = L.Fabric(devices=world, strategy=shardlab_fabric.ShardLabStrategy(**options), **QUIET)
    fabric.launch()
    return fabric


def _one_step(fabric: L.Fabric, model, optimizer, step: int) -> None:
    """One optimizer step on global batch ``step`` (8 sequences), split over this world's ranks: the gradient
    is the global mean whatever the world size."""
    world, rank = fabric.world_size, fabric.global_rank
    x, y = token_dataset(8 * (step + 1), seed=step + 10).tensors
    x, y = x[-8:][rank::world], y[-8:][rank::world]
    logits = model(x)
    fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    optimizer.step()
    optimizer.zero_grad()


def save_both_front_doors(directory: str) -> dict:
    """2 ranks: a Trainer run saves its checkpoint; a Fabric run loads its weights (load_raw), trains a step and
    saves a sharded checkpoint; the guard watches the Fabric steps."""
    from lightning_shardlab import SanityConfig, SanityGuard, ShardLabStrategy
    from tests.models import OrderedData

    torch.manual_seed(0)
    trainer = L.Trainer(
        devices=2, strategy=ShardLabStrategy(stage=2), max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False, **QUIET,
    )  # fmt: skip
    lightning_model = TinyGPT(n_layer=2)
    trainer.fit(lightning_model, OrderedData(token_dataset(8), 2))
    trainer.save_checkpoint(Path(directory) / "trainer")
    trainer.save_checkpoint(Path(directory) / "trainer_weights", weights_only=True)
    trainer_weights = trainer.strategy.full_state_dict()
    full = L.Trainer(
        devices=2, strategy=ShardLabStrategy(stage=3, state_dict_type="full"), max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, **QUIET,
    )  # fmt: skip
    full.fit(TinyGPT(n_layer=2), OrderedData(token_dataset(8), 2))
    full.save_checkpoint(Path(directory) / "trainer_full.ckpt")
    full.save_checkpoint(Path(directory) / "trainer_full_weights.ckpt", weights_only=True)
    fabric = _fabric(2, stage=3)
    torch.manual_seed(7)  # other initial weights: the load must replace them
    model = TinyGPT(n_layer=2)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load_raw(Path(directory) / "trainer", model)
    loaded = fabric.strategy.full_state_dict(model)
    guard = SanityGuard(fabric.strategy.sharded_model(model), [optimizer], SanityConfig(every_n_steps=1))
    with guard:
        for step in range(2):
            guard.before_step(step, None)
            _one_step(fabric, model, optimizer, step)
    fabric.save(Path(directory) / "fabric", {"model": model, "optimizer": optimizer, "step": 2})
    fabric.save(Path(directory) / "fabric_weights", {"model": model, "step": 2})
    return {
        "trainer": trainer_weights,
        "loaded": loaded,
        "saved": fabric.strategy.full_state_dict(model),
        "full": full.strategy.full_state_dict(),
    }


def resume_elsewhere(directory: str, stage: int) -> dict:
    """Any world size and stage: load the 2-rank stage-3 checkpoint, take one more step on the same global batch."""
    fabric = _fabric(int(os.environ["WORLD_SIZE"]), stage=stage)
    torch.manual_seed(5)
    model = TinyGPT(n_layer=2)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(Path(directory) / "fabric", state)
    loaded = fabric.strategy.full_state_dict(model)
    _one_step(fabric, model, optimizer, state["step"])
    return {"loaded": loaded, "after": fabric.strategy.full_state_dict(model), "step": state["step"]}


def trainer_loads_fabric_weights(directory: str) -> dict:
    """The other way round: a Trainer run loads the Fabric checkpoint's weights in on_fit_start."""
    from lightning_shardlab import ShardLabStrategy

    class LoadRaw(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            trainer.strategy.load_raw(Path(directory) / "fabric")
            self.loaded = trainer.strategy.full_state_dict()

    callback = LoadRaw()
    trainer = L.Trainer(
        devices=int(os.environ["WORLD_SIZE"]), strategy=ShardLabStrategy(stage=1), max_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
        **QUIET,
    )  # fmt: skip
    trainer.fit(TinyGPT(n_layer=2), torch.utils.data.DataLoader(token_dataset(4), batch_size=2))
    return callback.loaded


def test_checkpoints_move_between_world_sizes_stages_and_front_doors(tmp_path: Path) -> None:
    """Saved at 2 ranks (stage 3), loaded at 1 rank (stage 2) and 4 ranks (stage 1): the same weights, and the
    same next step; consolidation equals the live weights; weights go Trainer -> Fabric -> Trainer."""
    (saved, _) = run_ranks("tests.test_fabric:save_both_front_doors", 2, {"directory": str(tmp_path)}, timeout=240)
    for name, value in saved["trainer"].items():
        assert torch.equal(saved["loaded"][name], value), name  # Trainer checkpoint -> Fabric load_raw
    (one,) = run_ranks("tests.test_fabric:resume_elsewhere", 1, {"directory": str(tmp_path), "stage": 2}, timeout=120)
    four = run_ranks("tests.test_fabric:resume_elsewhere", 4, {"directory": str(tmp_path), "stage": 1}, timeout=240)
    assert one["step"] == four[0]["step"] == 2
    assert any(not torch.equal(one["after"][k], v) for k, v in saved["saved"].items())  # the step stepped
    for name, value in saved["saved"].items():
        assert torch.equal(one["loaded"][name], value) and torch.equal(four[0]["loaded"][name], value), name
        assert_close(four[0]["after"][name], one["after"][name], **FP32)  # optimizer state resharded too
    info = describe(tmp_path / "fabric", verify=True)  # shardlab inspect reads it
    assert info["problems"] == [] and (info["world_size"], info["stage"]) == (2, 3)
    full = consolidated_checkpoint(tmp_path / "fabric")
    assert set(full) == {"model", "optimizer", "step"} and full["step"] == 2
    assert all(torch.equal(full["model"][k], v) for k, v in saved["saved"].items())
    assert set(full["optimizer"]) == {"state", "param_groups"}
    own = torch.load(tmp_path / "fabric", weights_only=True)  # the sharded checkpoint's path: the user's keys, weights
    assert own["step"] == 2 and all(torch.equal(own["model"][k], v) for k, v in saved["saved"].items())
    loaded = run_ranks("tests.test_fabric:trainer_loads_fabric_weights", 2, {"directory": str(tmp_path)}, timeout=180)
    assert all(torch.equal(loaded[0][k], v) for k, v in saved["saved"].items())  # Fabric -> Trainer load_raw
    for name, weights, optimizers in (
        ("trainer", saved["trainer"], 1), ("trainer_weights", saved["trainer"], 0),
        ("trainer_full.ckpt", saved["full"], 1), ("trainer_full_weights.ckpt", saved["full"], 0),
        ("fabric", saved["saved"], 1), ("fabric_weights", saved["saved"], 0),
    ):  # fmt: skip
        _assert_tools_read(tmp_path / name, tmp_path / "tools" / name, weights, optimizers)


def _assert_tools_read(checkpoint: Path, work: Path, weights: dict[str, Tensor], optimizers: int) -> None:
    """Every ``shardlab`` tool, through the CLI, on one checkpoint kind: exit 0, the optimizer states counted,
    the consolidated and exported weights equal to the run's (a tied tensor exported once)."""
    out = every_tool(checkpoint, work)
    for tool in ("inspect", "consolidate", "inspect_consolidated", "export"):
        if tool in out:
            assert out[tool][0] == 0, (checkpoint.name, tool, out[tool][1])
    if "consolidate" in out:
        assert f" {optimizers} optimizer state(s)" in out["consolidate"][1], out["consolidate"][1]
        state_dict, saved_optimizers = full_parts(out["consolidated"])
        assert len(saved_optimizers) == optimizers and state_dict.keys() == weights.keys(), checkpoint.name
        assert all(torch.equal(state_dict[k], v) for k, v in weights.items()), checkpoint.name
    last_inspect = out.get("inspect_consolidated", out["inspect"])[1]
    assert f" {optimizers} optimizer state(s)" in last_inspect and f" {len(weights)} tensors" in last_inspect
    assert out["exported"] and all(torch.equal(v, weights[k]) for k, v in out["exported"].items()), checkpoint.name


# ---- one rank: what a Fabric user calls, and bad input ----


def fabric_features(directory: str) -> dict:
    out: dict = {}
    fabric = _fabric(1, stage=3)
    loose = TinyGPT(n_layer=1)
    try:
        fabric.no_backward_sync(loose)
    except TypeError as error:
        out["no_sync_unset"] = str(error)
    early = _fabric(1, stage=2)
    try:
        early.setup_optimizers(torch.optim.AdamW(TinyGPT(n_layer=1).parameters()))
    except ValueError as error:
        out["optimizer_first"] = str(error)
    # fabric.init_module(empty_init=True): no values until setup builds them; load_raw fills them
    torch.manual_seed(0)
    eager = TinyGPT(n_layer=2)
    path = Path(directory) / "weights.pt"
    torch.save(eager.state_dict(), path)
    with fabric.init_module(empty_init=True):
        lazy = TinyGPT(n_layer=2)
    out["meta_before_setup"] = all(p.is_meta for p in lazy.parameters())
    model, optimizer = fabric.setup(lazy, torch.optim.AdamW(lazy.parameters(), lr=1e-2))
    fabric.load_raw(path, model)
    full = fabric.strategy.full_state_dict(model)
    out["load_raw_equal"] = all(torch.equal(full[k], v) for k, v in eager.state_dict().items())
    # several models and optimizers: each model sharded on its own, each optimizer steps its own masters
    torch.manual_seed(1)
    a, b = TinyGPT(n_layer=1), TinyGPT(n_layer=1)
    reference = [TinyGPT(n_layer=1), TinyGPT(n_layer=1)]
    for ref, m in zip(reference, (a, b)):
        ref.load_state_dict(m.state_dict())
    two = _fabric(1, stage=3)
    a, opt_a = two.setup(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    b, opt_b = two.setup(b, torch.optim.AdamW(b.parameters(), lr=1e-2))
    ref_opts = [torch.optim.SGD(reference[0].parameters(), lr=0.1, momentum=0.9),
                torch.optim.AdamW(reference[1].parameters(), lr=1e-2)]  # fmt: skip
    x, y = token_dataset(2).tensors
    for _ in range(3):
        for model_, opt in ((a, opt_a), (b, opt_b)):
            logits = model_(x)
            two.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), model=model_)
            opt.step()
            opt.zero_grad()
        for ref, opt in zip(reference, ref_opts):
            logits = ref(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    for ref, model_ in zip(reference, (a, b)):
        full = two.strategy.full_state_dict(model_)
        assert_close(dict(full), {k: v.detach() for k, v in ref.state_dict().items()}, **FP32)
    out["several_models"] = True
    # precisions: every one trains, and refuses what it cannot honour
    out["losses"] = {}
    for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
        run = L.Fabric(devices=1, strategy=shardlab_fabric.ShardLabStrategy(stage=3), precision=precision, **QUIET)
        run.launch()
        torch.manual_seed(0)
        m = TinyGPT(n_layer=1)
        m, opt = run.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        losses = []
        for _ in range(4):
            logits = m(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            run.backward(loss)
            run.clip_gradients(m, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["losses"][precision] = losses
    # state_dict_type="full": one file, in the user's keys, as Fabric's own full save writes it; it loads back
    full_run = _fabric(1, stage=3, state_dict_type="full")
    torch.manual_seed(0)
    m = TinyGPT(n_layer=1)
    m, opt = full_run.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
    logits = m(x)
    full_run.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    full_run.clip_gradients(m, opt, clip_val=1e-4)  # elementwise, on each rank's slice: exact
    shards = full_run.strategy.sharded_model(m).masters(p for group in opt.param_groups for p in group["params"])
    grads = [s.grad for s in shards if s.grad is not None]  # this rank's slices of the averaged gradients
    out["clip_val"] = bool(grads) and all(float(g.abs().max()) <= 1e-4 for g in grads if g.numel())
    opt.step()
    file = Path(directory) / "full.ckpt"
    full_run.save(file, {"model": m, "optimizer": opt, "step": 1})
    full_run.save(Path(directory) / "full_weights.ckpt", {"model": m, "step": 1})
    out["full_weights"] = full_run.strategy.full_state_dict(m)
    written = torch.load(file, weights_only=True)
    out["full_keys"] = sorted(written)
    again = TinyGPT(n_layer=1)
    again, opt2 = full_run.setup(again, torch.optim.AdamW(again.parameters(), lr=1e-2))
    state = {"model": again, "optimizer": opt2, "step": 0}
    full_run.load(file, state)
    reloaded = full_run.strategy.full_state_dict(again)
    out["full_roundtrip"] = state["step"] == 1 and all(torch.equal(reloaded[k], v) for k, v in written["model"].items())
    out["full_optimizer"] = opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    try:
        L.Fabric(devices=1, strategy=shardlab_fabric.ShardLabStrategy(), precision="16-true", **QUIET)
    except ValueError as error:
        out["refused_precision"] = str(error)
    return out


def test_what_a_fabric_user_calls_on_one_rank(tmp_path: Path) -> None:
    (out,) = run_ranks("tests.test_fabric:fabric_features", 1, {"directory": str(tmp_path)}, timeout=240)
    assert "set up the model first" in out["no_sync_unset"]
    assert (
        "set up before its module" in out["optimizer_first"] and "fabric.setup_module(model)" in out["optimizer_first"]
    )
    assert out["meta_before_setup"] and out["load_raw_equal"] and out["several_models"]
    assert out["full_keys"] == ["model", "optimizer", "step"] and out["full_roundtrip"] and out["full_optimizer"]
    for name, optimizers in (("full.ckpt", 1), ("full_weights.ckpt", 0)):  # Fabric's full files, through the CLI
        _assert_tools_read(tmp_path / name, tmp_path / "tools" / name, out["full_weights"], optimizers)
    assert out["clip_val"]
    for precision, losses in out["losses"].items():
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (precision, losses)
    assert "precision='16-true'" in out["refused_precision"] and "bf16-mixed" in out["refused_precision"]


def test_fabric_registry_and_options() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_shardlab  # noqa: F401  (registers the names)

    for name, stage, offload in (
        ("shardlab", 3, "none"), ("shardlab_stage_1", 1, "none"), ("shardlab_stage_2", 2, "none"),
        ("shardlab_stage_3", 3, "none"), ("shardlab_stage_2_offload", 2, "auto"),
        ("shardlab_stage_3_offload", 3, "auto"),
    ):  # fmt: skip
        strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(strategy, shardlab_fabric.ShardLabStrategy) and int(strategy.config.stage) == stage
        assert strategy.config.offload == offload
    with pytest.raises(ValueError, match="unknown option.*'stag'.*Allowed: stage"):
        shardlab_fabric.ShardLabStrategy(stag=2)
    with pytest.raises(ValueError, match="`stage=4` is invalid"):
        shardlab_fabric.ShardLabStrategy(stage=4)


def test_the_fabric_example_trains_with_the_budget_guard_and_vitals(tmp_path: Path) -> None:
    """``python examples/fabric_loop.py``: stage 3 on 2 CPU ranks (Fabric launches them), a sharded save and
    reload half-way; the budget's measured memory equals its prediction; the dashboard is written."""
    out = tmp_path / "run"
    (log,) = run_commands([[sys.executable, "examples/fabric_loop.py", "--steps", "6", "--out", str(out)]], timeout=300)
    losses = [float(line.split("loss ")[1].split()[0]) for line in log.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0], log
    budget = json.loads((out / "shardlab_budget.json").read_text())
    assert [r["rank"] for r in budget] == [0, 1] and all(r["stage"] == 3 for r in budget)
    for rank in budget:
        for category in ("params", "grads", "optimizer_state"):
            assert rank["memory_measured"][category] == rank["memory_predicted"][category], (category, rank)
    assert (out / "vitals" / "vitals.html").exists() and "vital signs dashboard:" in log
    assert (shards_of(out / "checkpoint") / "COMPLETE").exists()
