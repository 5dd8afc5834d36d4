"""Checkpoints that never lie: a rank killed mid-save, a rank that cannot write, damaged files, bad input.

Every refusal must happen on every rank, with the same message, naming the file (or the option, or the
parameter) and ending with a HINT, and never hang.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch

import lightning_shardlab.checkpoint.sharded_save as checkpoint_sharded
from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.describe import describe
from lightning_shardlab.checkpoint.format import shards_of, unfinished_saves
from tests.helpers.launch import RankFailed, run_ranks
from tests.models import OrderedData, TinyGPT, token_dataset
from tests.test_checkpoint import QUIET, differences, snapshot


def _fit(epochs: int, ckpt_path: str | None = None, seed: int = 0) -> L.Trainer:
    torch.manual_seed(seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardLabStrategy(stage=3),
        max_epochs=epochs,
        enable_checkpointing=False,
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(TinyGPT(), OrderedData(token_dataset(16), 2), ckpt_path=ckpt_path)
    return trainer


def _dies_while_writing_shards(obj: dict, path: Path) -> dict:
    """Rank 1's shard file: half written, then the process is killed (SIGKILL: no cleanup runs)."""
    torch.save(obj, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def save_then_die(tmp: str) -> dict:
    """Save ``ckpt`` after epoch 1; train a second epoch; save ``ckpt`` again, but rank 1 dies mid-write."""
    path = Path(tmp) / "ckpt"
    _fit(1).save_checkpoint(path)
    trainer = _fit(2, ckpt_path=str(path))
    if trainer.global_rank == 1:
        checkpoint_sharded.write_torch = _dies_while_writing_shards
    trainer.save_checkpoint(path)
    return {}


def _refusal(action) -> tuple[str, str] | None:  # noqa: ANN001
    try:
        action()
    except (CheckpointError, ValueError, KeyError) as err:
        return type(err).__name__, str(err)
    return None


def resume_and_refuse(tmp: str, variants: list[str]) -> dict:
    """The surviving checkpoint resumes exactly; damaged ones are refused; a rank that cannot write fails the save
    on every rank and leaves the checkpoint as it was."""
    tmp_dir = Path(tmp)
    straight = snapshot(_fit(2))
    resumed_trainer = _fit(2, ckpt_path=str(tmp_dir / "ckpt"), seed=1)
    resumed = snapshot(resumed_trainer)
    refused = {}
    for name in variants:
        model = TinyGPT(n_embd=24) if name == "other_model" else TinyGPT()
        source = tmp_dir / ("ckpt" if name == "other_model" else name)
        evaluator = L.Trainer(
            accelerator="cpu", devices=2, strategy=ShardLabStrategy(stage=3), limit_val_batches=1, **QUIET
        )
        refused[name] = _refusal(
            lambda: evaluator.validate(model, OrderedData(token_dataset(16), 2), ckpt_path=str(source), verbose=False)
        )

    def no_space(obj: dict, path: Path) -> dict:
        raise OSError(28, "No space left on device", str(path))

    fill = no_space if resumed_trainer.global_rank == 1 else checkpoint_sharded.write_torch
    with mock.patch.object(checkpoint_sharded, "write_torch", fill):  # undone after: the process serves more tests
        refused["rank_1_cannot_write"] = _refusal(lambda: resumed_trainer.save_checkpoint(tmp_dir / "ckpt"))
    return {"differences": differences(straight, resumed), "refused": refused}


def _damage(ckpt: Path, tmp: Path) -> dict[str, str]:
    """Damaged copies of ``ckpt``: name -> the file the error must name."""
    expected = {}

    def copy(name: str, file: str) -> Path:  # the shard directory (which loads as the checkpoint it is)
        shutil.copytree(shards_of(ckpt), tmp / name)
        expected[name] = file
        return tmp / name

    shard0, shard1 = "shard-00000-of-00002.pt", "shard-00001-of-00002.pt"
    target = copy("truncated", shard1) / shard1
    target.write_bytes(target.read_bytes()[:-100])
    target = copy("altered", shard0) / shard0
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    target.write_bytes(bytes(data))
    (copy("missing", shard1) / shard1).unlink()
    (copy("incomplete", "COMPLETE") / "COMPLETE").unlink()
    target = copy("metadata", "metadata.json") / "metadata.json"
    target.write_text(target.read_text().replace('"stage": 3', '"stage": 1'))
    target = copy("trainer_state", "trainer_state.pt") / "trainer_state.pt"
    target.write_bytes(target.read_bytes()[:-1])
    (tmp / "alone").mkdir()
    shutil.copy(ckpt, tmp / "alone" / ckpt.name)  # the model file without its shards
    expected[f"alone/{ckpt.name}"] = f"{ckpt.name}.shards-"
    expected["nowhere"] = "nowhere"
    return expected


def test_killed_rank_leaves_the_previous_checkpoint_and_damage_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as died:
        run_ranks("tests.test_checkpoint_faults:save_then_die", 2, {"tmp": str(tmp_path)}, timeout=180)
    assert died.value.rank == 1 and "exited with -9" in str(died.value)
    ckpt = tmp_path / "ckpt"
    assert describe(ckpt, verify=True)["problems"] == []  # the previous checkpoint: complete, every checksum right
    unfinished, model_file = unfinished_saves(ckpt)  # the interrupted save: never marked complete, never in place
    assert model_file.name.startswith("ckpt.tmp-") and unfinished.name.startswith("ckpt.shards-")
    assert not (unfinished / "COMPLETE").exists() and not (unfinished / "metadata.json").exists()
    assert (unfinished / "shard-00001-of-00002.pt").stat().st_size > 0  # rank 1 died mid-write
    shutil.copytree(unfinished, tmp_path / "unfinished")
    expected = {**_damage(ckpt, tmp_path), "unfinished": "unfinished"}

    reports = run_ranks(
        "tests.test_checkpoint_faults:resume_and_refuse",
        2,
        {"tmp": str(tmp_path), "variants": [*expected, "other_model"]},
        timeout=300,
    )
    assert reports[0]["differences"] == []  # the surviving checkpoint resumes exactly
    for name, file in expected.items():
        refusals = [r["refused"][name] for r in reports]
        assert refusals[0] is not None, name
        assert refusals[0] == refusals[1], (name, refusals)  # the same error on every rank
        kind, message = refusals[0]
        assert kind == "CheckpointError" and file in message and "HINT:" in message, (name, message)
    assert "incomplete" in reports[0]["refused"]["unfinished"][1]
    assert "found by rank 0" in reports[0]["refused"]["altered"][1]  # only rank 0 reads that file
    kind, message = reports[0]["refused"]["other_model"]
    assert kind == "ValueError" and "'wte.weight'" in message and "HINT:" in message
    assert reports[1]["refused"]["other_model"] == (kind, message)
    kind, message = reports[0]["refused"]["rank_1_cannot_write"]
    assert kind == "CheckpointError" and "rank 1 could not write" in message and "No space left" in message
    assert reports[1]["refused"]["rank_1_cannot_write"] == (kind, message)
    assert describe(ckpt, verify=True)["problems"] == []  # the failed save changed nothing
    assert unfinished_saves(ckpt) == [unfinished, model_file]  # and cleaned up after itself


def test_state_dict_type_is_validated() -> None:
    with pytest.raises(ValueError, match="state_dict_type") as err:
        ShardLabStrategy(state_dict_type="zip")
    assert "'sharded'" in str(err.value) and "'full'" in str(err.value)
