"""torch Distributed Checkpoint (DCP) in and out, at any world size, proved against torch FSDP2 on CPU gloo.

One chain on the example GPT (tiny: 2 blocks of width 16, its tied head, two param groups, AdamW):

    2 ranks: FSDP2 (fully_shard) trains 2 steps, dcp.save {"model", "optim"} (torch's tutorial layout) and
        {"model"} alone; FSDP2's own resume of the first: one step                     -> reference A
        Lightning's ModelParallelStrategy (FSDP2 inside; it runs on CPU) trains 2 steps and saves its DCP
    4 ranks, shardlab, state_dict_type="dcp": fit(ckpt_path=FSDP2's) at stages 1, 2, 3: one step == A;
        stage 3 saves its DCP checkpoint (and a save that rank 1 cannot write changes nothing); stage 2
        resumes it: one step                                                           -> reference B
        Lightning's checkpoint loads bit for bit with its loops; the weights-only one loads and warns; another
        model's is refused naming keys; a DCP directory without state_dict_type="dcp" is refused unopened
    2 ranks: FSDP2 dcp.loads shardlab's checkpoint (Lightning's {"state_dict", "optimizer_0"}): one step == B, as
        does Fabric; dcp_to_torch_save of it holds what shardlab saved, and `shardlab export --format dcp` of
        the same state saved sharded gives the same tensors

Lightning's FSDPStrategy (FSDP1) refuses CPU; its DCP layout is ModelParallelStrategy's, which is checked here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.dcp_boxes import run_boxes
from lightning_shardlab.checkpoint.dcp_describe import describe_dcp
from lightning_shardlab.checkpoint.dcp_names import match
from lightning_shardlab.checkpoint.describe import main as inspect_main
from lightning_shardlab.checkpoint.export import main as export_main
from lightning_shardlab.examples.gpt import GPT
from tests.helpers.launch import run_ranks
from tests.helpers.reference import FP32, init_from_env
from tests.models import OrderedData
from tests.test_checkpoint import QUIET

QUIET_FABRIC = {"accelerator": "cpu"}

SHARDLAB_RANKS, FSDP2_RANKS, SAMPLES = 4, 2, 8  # one global batch of 8 samples per epoch


# ---- pure parts: boxes and names ----


def test_run_boxes_cover_each_run_exactly() -> None:
    for shape in [(), (7,), (3, 5), (2, 3, 4), (1, 4, 1, 3)]:
        n = math.prod(shape)
        for a, b in itertools.combinations_with_replacement(range(n + 1), 2):
            boxes = run_boxes(shape, a, b)
            covered = []
            for box in boxes:
                index = torch.arange(n).view(shape)
                for dim, (o, s) in enumerate(zip(box.offsets, box.sizes)):
                    index = index.narrow(dim, o, s)
                assert index.reshape(-1).tolist() == list(range(box.start, box.start + box.numel)), (shape, a, b)
                covered += index.reshape(-1).tolist()
            assert covered == list(range(a, b)), (shape, a, b, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
    with pytest.raises(ValueError, match="not inside"):
        run_boxes((3, 5), 4, 16)


def test_dcp_with_async_save_is_refused_naming_both() -> None:
    from lightning_shardlab import ShardLabConfig

    with pytest.raises(ValueError, match="async_save=True.*state_dict_type='dcp'.*HINT"):
        ShardLabConfig(state_dict_type="dcp", async_save=True)
    with pytest.raises(ValueError, match="state_dict_type"):
        ShardLabConfig(state_dict_type="torch_dcp")


def test_names_matched_as_the_source_wrote_them() -> None:
    ours = [["wte.weight", "lm_head.weight"], ["blocks.0.attn.weight"], ["ln_f.weight"]]
    saved = ["model.wte.weight", "model.blocks.0.attn.weight", "model.ln_f.weight", "optim.state.wte.weight.step"]
    assert match(ours, saved) == (["model.wte.weight", "model.blocks.0.attn.weight", "model.ln_f.weight"], "model.")
    compiled = ["_orig_mod.lm_head.weight", "_orig_mod.blocks.0.attn.weight", "_orig_mod.ln_f.weight"]  # tied: 2nd name
    assert match(ours, compiled)[0] == compiled[:1] + compiled[1:]
    wrapped = [[f"model.{n}" for n in names] for names in ours]  # a LightningModule holding the net as self.model
    assert match(wrapped, ["state_dict.wte.weight", "state_dict.blocks.0.attn.weight", "state_dict.ln_f.weight"])[
        0
    ] == [
        "state_dict.wte.weight",
        "state_dict.blocks.0.attn.weight",
        "state_dict.ln_f.weight",
    ]
    assert match(ours, ["model.other.weight"])[0] == [None, None, None]


def test_sgd_momentum_by_name_in_one_process(tmp_path: Path) -> None:
    """torch's own SGD (momentum) on OddNet (odd shapes, one-element parameters) saved with get_state_dict, read by
    the engine at stage 3 (world of one: every parameter's run is all of it) with the compiled names' prefix:
    the next step equals torch's own resume."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_shardlab import Comm, ShardLabConfig, shard_model, shard_optimizer
    from lightning_shardlab.checkpoint import dcp_load
    from lightning_shardlab.checkpoint.dcp_read import DcpReader
    from tests.models import OddNet

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    source = OddNet()
    sgd = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        step(source, sgd)
    model_sd, optim_sd = get_state_dict(source, sgd)
    compiled = {f"_orig_mod.{k}": v for k, v in model_sd.items()}  # as a torch.compile'd module names them
    dcp.save({"model": compiled, "optim": optim_sd}, checkpoint_id=tmp_path / "sgd", no_dist=True)
    torch.manual_seed(1)
    reference, sharded_net = OddNet(), OddNet()
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.1)  # the checkpoint's settings win
    set_state_dict(reference, ref_sgd, model_state_dict=model_sd, optim_state_dict=optim_sd)
    step(reference, ref_sgd)

    sharded = shard_model(sharded_net, ShardLabConfig(stage=3, state_dict_type="dcp"), Comm.single())
    optimizer = torch.optim.SGD(sharded_net.parameters(), lr=0.5, momentum=0.1)
    shard_optimizer(optimizer, sharded)
    reader = DcpReader.open(tmp_path / "sgd")
    dcp_load.load_model(sharded, reader, strict=True)
    dcp_load.load_optimizers([optimizer], sharded, reader)
    assert [(g["lr"], g["momentum"]) for g in optimizer.param_groups] == [(0.1, 0.9)]
    with sharded.step(keep_root_gathered=True):
        loss = F.mse_loss(sharded_net(x), y)
    sharded.prepare_backward(loss)
    loss.backward()
    optimizer.step()
    named = dict(reference.named_parameters())
    for fp in sharded.flat_params:
        for slot in fp.layout.slots:
            value = fp.master[slot.offset : slot.offset + slot.numel].view(slot.shape)
            assert_close(value, named[slot.name].detach(), **FP32, msg=lambda m, n=slot.name: f"{n}: {m}")


# ---- the chain against FSDP2 ----


class DcpGPT(GPT):
    """The example GPT with a constant learning rate (no schedule), recording its training losses."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: list[float] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(self.param_groups(), lr=hp.lr, betas=(hp.beta1, hp.beta2))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def _gpt(seed: int) -> DcpGPT:
    torch.manual_seed(seed)  # every model starts elsewhere: only a load makes two runs agree
    return DcpGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, lr=1e-2, warmup_steps=0)


def _data() -> TensorDataset:
    tokens = torch.randint(0, 32, (SAMPLES, 9), generator=torch.Generator().manual_seed(7))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _fsdp2(seed: int) -> tuple[DcpGPT, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = _gpt(seed), init_device_mesh("cpu", (FSDP2_RANKS,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model.configure_optimizers()


def _fsdp2_step(model: DcpGPT, optimizer: torch.optim.Optimizer) -> float:
    """One step on this rank's samples (r, r + 2, ...): the global batch of every shardlab step."""
    x, y = (t[dist.get_rank() :: FSDP2_RANKS] for t in _data().tensors)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / FSDP2_RANKS


def _full(model: DcpGPT) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _fsdp2_resume(path: str, layout: tuple[str, str]) -> dict[str, Any]:
    """FSDP2's own resume: dcp.load into its state dicts, one step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _fsdp2(seed=3)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if layout[0] == "state_dict":  # Lightning's layout keeps a LightningModule's own names (here: the same)
        state = {"state_dict": model_sd, "optimizer_0": optim_sd}
    else:
        state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state[layout[0]], optim_state_dict=state[layout[1]])
    return {"loss": _fsdp2_step(model, optimizer), "weights": _full(model)}


def fsdp2_save_and_resume(folder: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    init_from_env()  # the world's process group; the Lightning run below joins it (a second would meet this
    # one's keys in the same store)
    model, optimizer = _fsdp2(seed=1)
    for _ in range(2):
        _fsdp2_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/fsdp2")
    dcp.save({"model": model_sd}, checkpoint_id=f"{folder}/fsdp2-weights")
    saved = _full(model)
    out = {"saved": saved, **_fsdp2_resume(f"{folder}/fsdp2", ("model", "optim"))}
    out["lightning"] = _lightning_model_parallel(folder)
    return out


class ModelParallelGPT(DcpGPT):
    """The GPT as Lightning's ModelParallelStrategy wants it: sharded by FSDP2 in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def _lightning_model_parallel(folder: str) -> dict[str, Any]:
    """Lightning's own DCP checkpoint, made on CPU: ModelParallelStrategy (FSDP2 inside), 2 ranks, 2 steps."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(1)
    model = ModelParallelGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, lr=1e-2, warmup_steps=0)
    strategy = ModelParallelStrategy(data_parallel_size=FSDP2_RANKS, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=FSDP2_RANKS, strategy=strategy, max_steps=2, enable_checkpointing=False,
        limit_val_batches=0, **QUIET,
    )  # fmt: skip
    trainer.fit(model, datamodule=OrderedData(_data(), SAMPLES // FSDP2_RANKS))
    trainer.save_checkpoint(f"{folder}/lightning")
    return _full(model)


def _trainer(stage: int, max_steps: int, callbacks: list | None = None, **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=SHARDLAB_RANKS,
        strategy=ShardLabStrategy(stage=stage, **options),
        max_steps=max_steps,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        limit_val_batches=0,
        **QUIET,
    )


def _fit(
    stage: int, max_steps: int, ckpt: str, seed: int, callbacks: list | None = None
) -> tuple[L.Trainer, dict[str, Any]]:
    model = _gpt(seed)
    trainer = _trainer(stage, max_steps, callbacks, state_dict_type="dcp")
    trainer.fit(model, datamodule=OrderedData(_data(), SAMPLES // SHARDLAB_RANKS), ckpt_path=ckpt)
    loss = trainer.strategy.reduce(torch.tensor(model.losses[-1]), reduce_op="mean").item()
    return trainer, {"loss": loss, "weights": trainer.strategy.full_state_dict()}


def shardlab_chain(folder: str) -> dict[str, Any]:
    """The 4-rank part of the chain (the module docstring); ``.metadata`` reads are counted throughout."""
    from lightning_shardlab import CheckpointError

    out: dict[str, Any] = {}
    opened = []
    read_metadata = dcp.FileSystemReader.read_metadata

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(self.path))
        return read_metadata(self, *args, **kwargs)

    dcp.FileSystemReader.read_metadata = counted
    try:
        refused = _trainer(stage=3, max_steps=1)  # state_dict_type="sharded": DCP not asked for
        with pytest.raises(CheckpointError, match="Distributed Checkpoint") as info:
            refused.fit(_gpt(0), datamodule=OrderedData(_data(), 2), ckpt_path=f"{folder}/fsdp2")
        out["refused"], out["opened when refused"] = str(info.value), list(opened)
        for stage in (1, 2, 3):
            saves = [ModelCheckpoint(dirpath=f"{folder}/ckpts", save_last=True)] if stage == 3 else None
            trainer, out[stage] = _fit(stage, 1, f"{folder}/fsdp2", seed=2, callbacks=saves)
        trainer.save_checkpoint(f"{folder}/shardlab")  # stage 3, 4 ranks
        out["failed save"] = _failed_save(trainer, f"{folder}/shardlab")
        sharded = trainer.strategy.sharded  # what the checkpoint code reads the format from
        sharded.config = dataclasses.replace(sharded.config, state_dict_type="sharded")
        trainer.save_checkpoint(f"{folder}/sharded.ckpt")  # the same state, for `shardlab export --format dcp`
        trainer, out["own resume"] = _fit(2, 2, f"{folder}/shardlab", seed=4)
        trainer.save_checkpoint(f"{folder}/stage2")  # saved at stage 2 too
        checkpoint = trainer.strategy.load_checkpoint(f"{folder}/lightning")  # Lightning ModelParallel's, 2 ranks
        trainer.strategy.load_model_state_dict(checkpoint)
        trainer.strategy.load_optimizer_state_dict(checkpoint)
        out["lightning"] = {"weights": trainer.strategy.full_state_dict(), "global_step": checkpoint["global_step"]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint = trainer.strategy.load_checkpoint(f"{folder}/fsdp2-weights")
            trainer.strategy.load_model_state_dict(checkpoint)
            trainer.strategy.load_optimizer_state_dict(checkpoint)
        out["weights only"] = trainer.strategy.full_state_dict()
        checkpoint = trainer.strategy.load_checkpoint(f"{folder}/other")  # another model's names
        with pytest.raises(KeyError) as mismatch:
            trainer.strategy.load_model_state_dict(checkpoint)
        out["mismatch"] = str(mismatch.value)
        out["warnings"] = [str(w.message) for w in caught]
    finally:
        dcp.FileSystemReader.read_metadata = read_metadata
    return out


def _failed_save(trainer: L.Trainer, path: str) -> dict[str, Any]:
    """Saving again onto ``path`` while rank 1 cannot write: every rank raises, nothing changes on disk."""
    from lightning_shardlab import CheckpointError

    before = {p.name: p.stat().st_size for p in Path(path).iterdir()}
    write = dcp.FileSystemWriter.write_data

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device")

    if trainer.global_rank == 1:
        dcp.FileSystemWriter.write_data = full_disk
    try:
        with pytest.raises(CheckpointError) as info:
            trainer.save_checkpoint(path)
    finally:
        dcp.FileSystemWriter.write_data = write
    after = {p.name: p.stat().st_size for p in Path(path).iterdir()}
    return {"error": str(info.value), "unchanged": after == before, "beside": sorted(os.listdir(Path(path).parent))}


def fsdp2_reads_shardlab(folder: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    init_from_env()
    out = _fsdp2_resume(f"{folder}/shardlab", ("state_dict", "optimizer_0"))
    if dist.get_rank() == 0:
        dcp_to_torch_save(f"{folder}/shardlab", f"{folder}/one.pt")
        out["one file"] = torch.load(f"{folder}/one.pt", weights_only=False)
    out["fabric"] = _fabric_resume(folder)
    return out


def _fabric_resume(folder: str) -> dict[str, Any]:
    """Fabric's front door, 2 ranks, stage 2: fabric.load of shardlab's DCP checkpoint, one step, fabric.save."""
    from lightning_shardlab.fabric import ShardLabStrategy as FabricStrategy

    fabric = L.Fabric(devices=FSDP2_RANKS, strategy=FabricStrategy(stage=2, state_dict_type="dcp"), **QUIET_FABRIC)
    fabric.launch()
    model = _gpt(seed=5)
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    fabric.load(f"{folder}/shardlab", {"model": model, "optimizer": optimizer})
    x, y = (t[fabric.global_rank :: FSDP2_RANKS] for t in _data().tensors)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.save(f"{folder}/fabric", {"model": model, "optimizer": optimizer, "step": 1})
    mean = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
    return {"loss": mean, "weights": fabric.strategy.full_state_dict(model)}


def _one_file(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.with_suffix(".pt"))
    return torch.load(path.with_suffix(".pt"), weights_only=False)


def test_dcp_against_fsdp2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = str(tmp_path)
    dcp.save({"model": {"blocks.9.other.weight": torch.zeros(3)}}, checkpoint_id=tmp_path / "other", no_dist=True)
    fsdp2 = run_ranks("tests.test_dcp:fsdp2_save_and_resume", FSDP2_RANKS, {"folder": folder}, timeout=120)[0]
    chain = run_ranks("tests.test_dcp:shardlab_chain", SHARDLAB_RANKS, {"folder": folder}, timeout=240)[0]
    back = run_ranks("tests.test_dcp:fsdp2_reads_shardlab", FSDP2_RANKS, {"folder": folder}, timeout=120)[0]

    # safety: without state_dict_type="dcp", refused by its file names, its pickle never opened
    assert "state_dict_type='dcp'" in chain["refused"] and "HINT" in chain["refused"], chain["refused"]
    assert chain["opened when refused"] == []

    # in: FSDP2 (2 ranks) -> shardlab (4 ranks) at every stage, the same first step as FSDP2's own resume
    for stage in (1, 2, 3):
        assert_close(chain[stage]["loss"], fsdp2["loss"], **FP32)
        for key, value in fsdp2["weights"].items():
            assert_close(chain[stage]["weights"][key], value, **FP32, msg=lambda m, k=key, s=stage: f"{s} {k}: {m}")
    # Lightning's ModelParallelStrategy's own DCP checkpoint (FSDP2 inside; it runs on CPU): weights bit for bit,
    # its optimizer state by name, its loops from its meta.pt
    assert chain["lightning"]["global_step"] == 2
    for key, value in fsdp2["lightning"].items():
        assert torch.equal(chain["lightning"]["weights"][key], value), key
    # a DCP checkpoint without optimizer state: the weights, and a warning that the optimizers start fresh
    assert any("optimizers start fresh" in w for w in chain["warnings"]), chain["warnings"]
    # another model's checkpoint: the first names on each side, on every rank (rank 0's message here)
    assert "'wte.weight'" in chain["mismatch"] and "'model.blocks.9.other.weight'" in chain["mismatch"]
    assert "HINT" in chain["mismatch"], chain["mismatch"]
    for key, value in fsdp2["saved"].items():
        assert torch.equal(chain["weights only"][key], value), key

    # complete or absent: a rank that cannot write fails the save on every rank; the previous one stays as it was
    failed = chain["failed save"]
    assert "on rank 1" in failed["error"] and "No space left" in failed["error"] and failed["unchanged"], failed
    assert not [name for name in failed["beside"] if ".tmp-" in name], failed["beside"]

    # out: shardlab (4 ranks, stage 3) -> FSDP2 (2 ranks): the same first step as shardlab's own resume
    assert_close(back["loss"], chain["own resume"]["loss"], **FP32)
    for key, value in chain["own resume"]["weights"].items():
        assert_close(back["weights"][key], value, **FP32, msg=lambda m, k=key: f"{k}: {m}")
    # Fabric's front door loads it too (2 ranks, stage 2), and its fabric.save is a DCP checkpoint as well
    assert_close(back["fabric"]["loss"], chain["own resume"]["loss"], **FP32)
    fabric_saved = _one_file(tmp_path / "fabric")
    for key, value in chain["own resume"]["weights"].items():
        assert_close(back["fabric"]["weights"][key], value, **FP32, msg=lambda m, k=key: f"{k}: {m}")
        assert torch.equal(fabric_saved["state_dict"][key], back["fabric"]["weights"][key]), key
    # ... and dcp_to_torch_save makes one file of it: the weights shardlab held when it saved
    one = back["one file"]
    for key, value in chain[3]["weights"].items():
        assert torch.equal(one["state_dict"][key], value), key
    state = one["optimizer_0"]["state"]["wte.weight"]
    assert state["step"].item() == 3.0 and state["exp_avg"].shape == (32, 16)
    assert [g["weight_decay"] for g in one["optimizer_0"]["param_groups"]] == [0.1, 0.0]

    stage2 = _one_file(tmp_path / "stage2")  # a stage 2 save holds the weights it trained to
    for key, value in chain["own resume"]["weights"].items():
        assert torch.equal(stage2["state_dict"][key], value), key

    # ModelCheckpoint's files are DCP directories too (top-k and last), holding the same weights
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    for name in ("epoch=0-step=1.ckpt", "last.ckpt"):
        saved = _one_file(tmp_path / "ckpts" / name)["state_dict"]
        assert all(torch.equal(saved[k], v) for k, v in chain[3]["weights"].items()), name

    # shardlab export --format dcp of the same state saved sharded: the same tensors, in one process
    export_main([str(tmp_path / "sharded.ckpt"), str(tmp_path / "exported"), "--format", "dcp"])
    exported = _one_file(tmp_path / "exported")
    for part in ("state_dict", "optimizer_0"):
        assert exported[part].keys() == one[part].keys(), part
    for key, value in one["state_dict"].items():
        assert torch.equal(exported["state_dict"][key], value), key
    for name, values in one["optimizer_0"]["state"].items():
        for key, value in values.items():
            assert torch.equal(exported["optimizer_0"]["state"][name][key], value), (name, key)
    assert exported["optimizer_0"]["param_groups"] == one["optimizer_0"]["param_groups"]

    # shardlab inspect: --format dcp describes it (4 writer ranks, each parameter in chunks); without, refused
    info = describe_dcp(tmp_path / "shardlab")
    assert [r["rank"] for r in info["per_rank"]] == [0, 1, 2, 3] and info["meta"], info["per_rank"]
    assert info["optimizers"] == [
        {"prefix": "optimizer_0.", "groups": 2, "state_keys": ["exp_avg", "exp_avg_sq", "step"]}
    ]
    head = next(t for t in info["tensors"] if t["name"] == "state_dict.lm_head.weight")
    assert head["shape"] == [32, 16] and head["dtype"] == "float32"
    assert {r for t in info["tensors"] for r, _ in t["ranks"]} == {0, 1, 2, 3}  # every rank wrote its chunks
    assert any(len(t["ranks"]) > 1 for t in info["tensors"])  # and a parameter split between ranks is in pieces
    with pytest.raises(SystemExit):
        inspect_main([str(tmp_path / "fsdp2")])
    assert "state_dict_type='dcp'" in capsys.readouterr().out
    inspect_main([str(tmp_path / "fsdp2"), "--format", "dcp"])
    assert "optimizer optim.: 2 param groups, state exp_avg, exp_avg_sq, step" in capsys.readouterr().out
