"""Bad input: a clear error naming the option / parameter, on every rank, before any collective."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shardlab import Comm, ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from tests.helpers.launch import run_ranks
from tests.models import OddNet, OrderedData, TinyGPT, token_dataset

pytestmark = pytest.mark.quick  # the smoke tier (bash scripts/test.sh --quick)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"stage": 4}, ["stage", "1, 2, 3"]),
        ({"stage": "three"}, ["stage"]),
        ({"accumulation": "sometimes"}, ["accumulation", "'reduce', 'defer'"]),
        ({"unit_classes": ["no.such.Block"]}, ["unit_classes", "no.such.Block"]),
        ({"unit_classes": ["torch.optim.SGD"]}, ["unit_classes", "torch.optim.SGD", "nn.Module"]),
        ({"min_unit_params": -1}, ["min_unit_params"]),
        ({"ranks_per_device": 0}, ["ranks_per_device"]),
        ({"gradient_clip_norm_type": -2}, ["gradient_clip_norm_type"]),
        ({"process_group_backend": "mpi"}, ["process_group_backend", "'gloo', 'nccl'"]),
        ({"reshard_after_forward": "yes"}, ["reshard_after_forward"]),
        ({"reshard_after_forward": 1}, ["reshard_after_forward", ">= 2"]),
        ({"reshard_after_forward": 2, "stage": 2}, ["reshard_after_forward", "stage 3"]),
        ({"shard_group_size": 0}, ["shard_group_size", "'node'"]),
        ({"shard_group_size": "rack"}, ["shard_group_size"]),
        ({"unit_bucket_params": -1}, ["unit_bucket_params"]),
        ({"elementwise_optimizers": 5}, ["elementwise_optimizers", "list"]),
        ({"timeout_s": 0}, ["timeout_s"]),
        ({"offload": "nvme"}, ["offload", "'none', 'cpu', 'disk', 'auto'"]),
        ({"async_save": "yes"}, ["async_save", "True or False"]),
        ({"async_save": True, "state_dict_type": "full"}, ["async_save=True", "state_dict_type='sharded'"]),
        ({"offload": "disk", "offload_dir": 3}, ["offload_dir", "a directory path"]),
    ],
)
def test_invalid_option_raises_value_error_naming_it(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ShardLabStrategy(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_valid_options_are_settled_once() -> None:
    strategy = ShardLabStrategy(
        stage=2, accumulation="defer", gradient_clip_norm_type="inf", unit_classes=["torch.nn.TransformerEncoderLayer"]
    )
    assert int(strategy.config.stage) == 2 and strategy.config.accumulation.value == "defer"
    assert strategy.config.gradient_clip_norm_type == float("inf")
    assert strategy.config.unit_classes == (nn.TransformerEncoderLayer,)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (nn.TransformerEncoderLayer, (nn.TransformerEncoderLayer,)),
        ([nn.TransformerEncoderLayer, "torch.nn.Linear"], (nn.TransformerEncoderLayer, nn.Linear)),
        ({nn.Linear}, (nn.Linear,)),
        ("torch.nn.Linear", (nn.Linear,)),
    ],
)
def test_unit_classes_take_classes_import_paths_and_mixes(given: object, expected: tuple) -> None:
    # Lightning's FSDP takes auto_wrap_policy={Block}; a YAML config names import paths
    assert ShardLabStrategy(unit_classes=given).config.unit_classes == expected
    optimizers = ShardLabStrategy(elementwise_optimizers=[torch.optim.Adam, "torch.optim.SGD"]).config
    assert optimizers.elementwise_optimizers == (torch.optim.Adam, torch.optim.SGD)
    with pytest.raises(ValueError, match="unit_classes.*torch.optim.SGD.*not a torch.nn.Module"):
        ShardLabStrategy(unit_classes=[nn.Linear, torch.optim.SGD])


def test_unsupported_precision_is_refused_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match="precision='16-true'.*HalfPrecision.*shardlab"):
        L.Trainer(accelerator="cpu", devices=1, strategy="shardlab", precision="16-true", logger=False)


def test_non_elementwise_optimizer_is_refused_with_the_reason() -> None:
    sharded = shard_model(OddNet(), ShardLabConfig(), Comm.single())
    with pytest.raises(ValueError, match="LBFGS cannot run sharded: its step re-runs the closure"):
        shard_optimizer(torch.optim.LBFGS(sharded.module.parameters()), sharded)


def test_optimizer_over_foreign_tensors_is_refused() -> None:
    sharded = shard_model(OddNet(), ShardLabConfig(), Comm.single())
    stray = nn.Parameter(torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"shape \(5, 2\) that is not a parameter of the sharded OddNet"):
        shard_optimizer(torch.optim.SGD([stray], lr=0.1), sharded)


def test_state_dict_of_a_sharded_module_explains_how_to_get_the_full_one() -> None:
    sharded = shard_model(OddNet(), ShardLabConfig(stage=3), Comm.single())
    with pytest.raises(RuntimeError, match="full_state_dict"):
        sharded.module.state_dict()


def _differing_model_fit() -> None:
    """Rank 1 builds its GPT with a different block width: every rank must raise, naming it."""
    torch.manual_seed(0)
    model = TinyGPT()
    if int(os.environ["RANK"]) == 1:
        model.blocks[1].mlp.fc = nn.Linear(18, 71, bias=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ShardLabStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, OrderedData(token_dataset(8), 2))


def _fit_with(options: dict) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ShardLabStrategy(**options), max_steps=1, logger=False)
    trainer.fit(TinyGPT(), OrderedData(token_dataset(8), 2))


def _short_disk_fit(tmp: str) -> None:
    """offload='disk' where rank 1's offload_dir has 1,000 bytes free (its file system's answer, replaced)."""
    from lightning_shardlab.offload import space

    real = space.shutil.disk_usage
    short = (lambda path: real(path)._replace(free=1000)) if int(os.environ["RANK"]) == 1 else real
    with mock.patch.object(space.shutil, "disk_usage", short):
        _fit_with({"offload": "disk", "offload_dir": tmp})


GROUPS_AND_OFFLOADS = {  # a group size the world of 2 cannot be split into, an offload this run cannot have
    "shard_group_size": ({"shard_group_size": 3}, ["`shard_group_size=3` (3 ranks) must divide the world size 2"]),
    "reshard_after_forward": (
        {"reshard_after_forward": 3}, ["`reshard_after_forward=3` must divide the shard group size 2"],
    ),
    "offload cpu on CPU": ({"offload": "cpu"}, ["`offload='cpu'`", "trains on the CPU", "offload='disk'"]),
    "offload_dir missing": (
        {"offload": "disk", "offload_dir": "/no/such/dir"}, ["`offload_dir='/no/such/dir'` is not a directory"],
    ),
    "not writable": ({"offload": "disk", "offload_dir": "/proc"}, ["`offload_dir='/proc'` is not writable"]),
}  # fmt: skip


def refusals(tmp: str) -> dict[str, tuple[str, str, bool]]:
    """Every bad run of this file, one after another on the same 2 ranks: what each raised on this rank (its
    class, its message) and whether training had begun. A rank that did not raise, or hung, fails the job."""
    runs = {name: functools.partial(_fit_with, options) for name, (options, _) in GROUPS_AND_OFFLOADS.items()}
    runs["short disk"] = functools.partial(_short_disk_fit, tmp)
    runs["differing model"] = _differing_model_fit  # last: refused after the process group opened
    out = {}
    for name, run in runs.items():
        steps: list[int] = []

        def counted(self, *args, _step=TinyGPT.training_step, _steps=steps):  # noqa: ANN001, ANN002, ANN202
            _steps.append(1)
            return _step(self, *args)

        with mock.patch.object(TinyGPT, "training_step", counted):
            try:
                run()
            except Exception as error:  # noqa: BLE001  (what a user would see)
                out[name] = (type(error).__name__, str(error), bool(steps))
                continue
        raise AssertionError(f"{name}: rank {os.environ['RANK']} did not fail")
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, tuple[str, str, bool]]]:
    """One launch for every refusal below (its ranks survive them: each is refused on every rank)."""
    tmp = tmp_path_factory.mktemp("refusals")
    return run_ranks("tests.test_bad_input:refusals", 2, {"tmp": str(tmp)}, timeout=180)


def test_model_that_differs_across_ranks_raises_on_every_rank_without_hanging(refused: list[dict]) -> None:
    for rank, ranks in enumerate(refused):
        kind, message, trained = ranks["differing model"]
        assert kind == "ValueError" and "the model differs across ranks" in message, (rank, message)
        assert "blocks.1.mlp.fc.weight" in message and "(72, 18)" in message and "(71, 18)" in message
        assert not trained


@pytest.mark.parametrize("case", list(GROUPS_AND_OFFLOADS))
def test_group_sizes_and_offloads_a_run_cannot_have_are_refused_on_every_rank(case: str, refused: list[dict]) -> None:
    words = GROUPS_AND_OFFLOADS[case][1]
    for rank, ranks in enumerate(refused):
        kind, message, trained = ranks[case]
        assert kind == "ValueError" and all(w in message for w in words), (rank, message)
        assert "HINT" in message and not trained, (rank, message)


def test_offload_dir_without_room_for_the_layout_is_refused_on_every_rank_before_training(refused: list[dict]) -> None:
    for rank, ranks in enumerate(refused):
        kind, message, trained = ranks["short disk"]
        assert kind == "OffloadSpaceError" and "rank 1: offload_dir=" in message, (rank, message)
        assert "has 1,000 bytes free" in message, message
        assert "bytes per rank x 2 rank(s) on this machine" in message and "HINT" in message, message
        assert not trained  # before training


def test_a_full_disk_while_making_an_offload_file_names_the_directory_and_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_shardlab.offload.mapped_files import FileTier, OffloadSpaceError

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadSpaceError, match=r"could not reserve 4,000 bytes for blocks.0.exp_avg in offload_dir="):
        FileTier(tmp_path).tensor("blocks.0.exp_avg", 1000, torch.float32)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_async_save_is_refused_where_no_point_completes_it() -> None:
    """Fabric has no end of fit to complete the last background save at; Lightning's AsyncCheckpointIO asks for
    background saves, which full files are not."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_shardlab import fabric as shardlab_fabric

    with pytest.raises(ValueError, match="`async_save=True` is for the Trainer"):
        shardlab_fabric.ShardLabStrategy(async_save=True)
    strategy = ShardLabStrategy(state_dict_type="full")
    strategy.checkpoint_io = AsyncCheckpointIO()
    with pytest.raises(ValueError, match="not state_dict_type='full' files"):
        _ = strategy.saver
    strategy = ShardLabStrategy()
    strategy.checkpoint_io = AsyncCheckpointIO()
    assert strategy.saver is not None  # Lightning's plugin: sharded saves go to the background


def test_export_refuses_bad_input_naming_the_option_or_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``shardlab export``: each mistake is an error naming what is wrong, and nothing is written."""
    from lightning_shardlab.checkpoint.atomic import CheckpointError
    from lightning_shardlab.checkpoint.export import export, main

    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"model.w": torch.ones(2)}}, full)
    (tmp_path / "taken").mkdir()
    (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint")
    cases = [
        ({"src": full, "dst": tmp_path / "a", "dtype": "int8"}, "--dtype 'int8' is not one of fp32, bf16, fp16"),
        ({"src": full, "dst": tmp_path / "taken"}, "exists. HINT: export into a new directory"),
        ({"src": full, "dst": tmp_path / "b", "prefix": "lm."}, "no tensors under --prefix 'lm.'"),
        ({"src": tmp_path / "garbage.ckpt", "dst": tmp_path / "c"}, "garbage.ckpt is not a readable checkpoint"),
        ({"src": tmp_path / "nowhere", "dst": tmp_path / "d"}, "nowhere is not a readable checkpoint"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, CheckpointError), match=message.replace("(", r"\(").replace(".", r"\.")):
            export(**kwargs)
    with pytest.raises(SystemExit, match="shardlab export: error: .*no tensors under --prefix"):
        main([str(full), str(tmp_path / "e"), "--prefix", "lm."])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt", "garbage.ckpt", "taken"]


def test_a_param_group_of_foreign_tensors_is_refused_when_it_is_added() -> None:
    sharded = shard_model(OddNet(), ShardLabConfig(), Comm.single())
    optimizer = torch.optim.AdamW(sharded.module.inp.parameters(), lr=0.1)
    shard_optimizer(optimizer, sharded)
    optimizer.add_param_group({"params": list(sharded.module.tiny.parameters()), "lr": 0.01})  # the module's own
    with pytest.raises(ValueError, match=r"the added param group of AdamW holds a tensor of shape \(3,\)"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(optimizer.param_groups) == 2
