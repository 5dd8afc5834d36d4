"""Checkpoints at scale: ``shardlab export`` to safetensors in the Hugging Face layout, and streamed consolidation.

One 2-rank run trains the Hugging Face GPT-2 example (tiny config, stage 3) two steps and saves a sharded
checkpoint; its ``full_state_dict()`` is the reference. Exported with ``--prefix model.``, the directory loads
with ``AutoModelForCausalLM.from_pretrained`` and equals the reference bit for bit (fp32, in several files
with an index), or its cast (``--dtype bf16``, one file); the keys are the ones ``save_pretrained`` writes for
the same model (the tied head once). A second 2-rank run saves a checkpoint of a 25M-parameter stack (AdamW:
about 300 MB); it is exported in several files and consolidated by streaming, each in a fresh process whose
peak memory (``ru_maxrss``) rises less than ``MEMORY_BOUND`` above its imports, against more than the
checkpoint's size for the in-memory consolidation, and what they wrote equals that consolidation's tensors. With
``async_save=True`` a checkpoint written in the background resumes bit for bit, and a rank killed while
writing one leaves the previous checkpoint of that name complete.
"""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.atomic import CheckpointError
from lightning_shardlab.checkpoint.consolidate import consolidate
from lightning_shardlab.checkpoint.export import export
from lightning_shardlab.checkpoint.format import CheckpointReader, shards_of, unfinished_saves
from tests.helpers.launch import run_ranks
from tests.helpers.peak_rss import peak_rss_growth
from tests.models import OrderedData, RegressionNet, WideBlocks, regression_dataset, token_dataset
from tests.test_checkpoint import QUIET
from tests.test_example_hf import TINY_GPT2

WORLD = 2


def hf_checkpoint(tmp: str) -> dict:
    from lightning_shardlab.examples.hf_gpt2 import HFGPT2

    torch.manual_seed(0)
    model = HFGPT2(config=TINY_GPT2, warmup_steps=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=ShardLabStrategy(stage=3), max_steps=2,
        enable_checkpointing=False, default_root_dir=tmp, **QUIET,
    )  # fmt: skip
    trainer.fit(model, OrderedData(token_dataset(8, vocab=256), 2))
    trainer.save_checkpoint(f"{tmp}/hf.ckpt")
    return trainer.strategy.full_state_dict()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


def _safetensors_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_export_of_the_hf_example_loads_with_from_pretrained_bit_for_bit(tmp_path: Path) -> None:
    import transformers

    full, _ = run_ranks("tests.test_checkpoints_at_scale:hf_checkpoint", WORLD, {"tmp": str(tmp_path)}, timeout=200)
    reference = {k.removeprefix("model."): v for k, v in full.items()}
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    written = export(tmp_path / "hf.ckpt", fp32, prefix="model.", max_shard_size=60_000)
    assert len(written["files"]) > 2 and (fp32 / "model.safetensors.index.json").is_file()
    export(tmp_path / "hf.ckpt", bf16, prefix="model.", dtype="bf16")
    assert (bf16 / "model.safetensors").is_file() and not (bf16 / "model.safetensors.index.json").exists()
    index = json.loads((fp32 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == _safetensors_keys(fp32)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(fp32, local_files_only=True)
    state = loaded.state_dict()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    again = tmp_path / "again"
    loaded.save_pretrained(again)  # transformers' own writer: the same keys (the tied head once)
    assert _safetensors_keys(again) == _safetensors_keys(fp32) == set(index["weight_map"])
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]

    consolidate(tmp_path / "hf.ckpt", tmp_path / "full.ckpt")  # a full checkpoint exports the same tensors
    export(tmp_path / "full.ckpt", tmp_path / "from_full", prefix="model.")
    assert _tensors(tmp_path / "from_full").keys() == _tensors(fp32).keys()
    assert all(torch.equal(v, _tensors(fp32)[k]) for k, v in _tensors(tmp_path / "from_full").items())
    assert json.loads((tmp_path / "from_full" / "config.json").read_text()) == json.loads(
        (fp32 / "config.json").read_text()
    )

    half = transformers.AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True, torch_dtype=torch.bfloat16)
    for key, value in half.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, reference[key].to(torch.bfloat16)), key


# ---- bounded memory: a 25M-parameter checkpoint ----

BIG = {"width": 1024, "depth": 12}  # 12 blocks of 2.1M parameters: 25.2M, built on the meta device
SHARD_BYTES = 20_000_000  # export's --max-shard-size here
# Peak memory that export and consolidate may add, far below the 303 MB checkpoint (and below any one kind of its
# state held whole: the masters are 101 MB, each moment as much): consolidate holds one tensor (its largest, 4 MB,
# in a staging buffer), export one 20 MB output file (its staging buffer); the rest is the pages of torch's and
# numpy's code that the work first runs.
MEMORY_BOUND = 100_000_000
STREAMING = """import torch
from lightning_shardlab.checkpoint.consolidate import consolidate, consolidated_checkpoint
from lightning_shardlab.checkpoint.export import export"""


def big_checkpoint(tmp: str) -> dict:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=ShardLabStrategy(stage=3), max_steps=1,
        enable_checkpointing=False, default_root_dir=tmp, **QUIET,
    )  # fmt: skip
    trainer.fit(WideBlocks(**BIG), OrderedData(regression_dataset(4), 2))
    trainer.save_checkpoint(f"{tmp}/big.ckpt")
    return {}


def test_export_and_consolidate_stream_a_large_checkpoint(tmp_path: Path) -> None:
    run_ranks("tests.test_checkpoints_at_scale:big_checkpoint", WORLD, {"tmp": str(tmp_path)}, timeout=300)
    src, hf, full, whole = tmp_path / "big.ckpt", tmp_path / "hf", tmp_path / "full.ckpt", tmp_path / "whole.ckpt"
    size = sum(f.stat().st_size for f in shards_of(src).iterdir())
    assert size > 3 * MEMORY_BOUND  # 25.2M parameters: 4 B masters + 8 B moments
    # each in a fresh process (the three at once: each measures only its own): how far it raises that process's
    # peak memory (ru_maxrss) beyond its imports
    work = {
        "export": f"export({str(src)!r}, {str(hf)!r}, max_shard_size={SHARD_BYTES})",
        "consolidate": f"consolidate({str(src)!r}, {str(full)!r})",
        "in memory": f"torch.save(consolidated_checkpoint({str(src)!r}), {str(whole)!r})",
    }
    with ThreadPoolExecutor(len(work)) as pool:
        growth = dict(zip(work, pool.map(functools.partial(peak_rss_growth, STREAMING), work.values())))
    assert growth["export"] < MEMORY_BOUND and growth["consolidate"] < MEMORY_BOUND, (growth, size)
    assert growth["in memory"] > 0.9 * size, (growth, size)  # the measure sees a whole checkpoint held at once
    assert len(list(hf.glob("*.safetensors"))) > 1 and (hf / "model.safetensors.index.json").is_file()
    # what was streamed is what the in-memory consolidation makes, tensor for tensor
    streamed = torch.load(full, mmap=True, weights_only=True)
    reference = torch.load(whole, mmap=True, weights_only=True)
    assert list(streamed["state_dict"]) == list(reference["state_dict"])
    assert all(torch.equal(streamed["state_dict"][k], v) for k, v in reference["state_dict"].items())
    for mine, theirs in zip(streamed["optimizer_states"], reference["optimizer_states"], strict=True):
        assert mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys()
        for j, state in theirs["state"].items():
            assert all(torch.equal(mine["state"][j][k], v) for k, v in state.items()), j
    exported = _tensors(hf)
    assert exported.keys() == reference["state_dict"].keys()
    assert all(torch.equal(v, reference["state_dict"][k]) for k, v in exported.items())


# ---- async_save ----

STEPS_PER_EPOCH, GLOBAL_BATCH = 3, 8


class SaveAtEpochEnd(Callback):
    """``trainer.save_checkpoint`` at the end of every epoch (``path`` may name the epoch: ``{epoch}``);
    ``fail_on=(rank, save)`` kills that rank while that save's files are written in the background."""

    def __init__(self, path: str, fail_on: tuple[int, int] | None = None) -> None:
        self.path, self.fail_on, self.saves = path, fail_on, 0

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.saves += 1
        if self.fail_on == (trainer.global_rank, self.saves):
            from lightning_shardlab.checkpoint import sharded_save as sharded

            def die(obj: Any, path: Path) -> None:  # on the background thread, mid-write: the process ends at once
                Path(path).write_bytes(b"partial")
                os._exit(9)

            sharded.write_torch = die
        trainer.save_checkpoint(self.path.format(epoch=trainer.current_epoch))


def _async_fit(tmp: str, callbacks: list, **kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=ShardLabStrategy(async_save=True), max_epochs=2,
        enable_checkpointing=False, default_root_dir=tmp, callbacks=callbacks, **QUIET,
    )  # fmt: skip
    torch.manual_seed(0)
    data = OrderedData(regression_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH), GLOBAL_BATCH // WORLD)
    trainer.fit(RegressionNet(), data, **kwargs)
    return trainer


class CompleteWhen(L.Callback):
    """Whether epoch 0's checkpoint is complete at the end of each batch of epoch 1 (before epoch 1's save)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch == 1:
            self.seen.append(shards_of(self.path) is not None)  # the model file moves into place last


def async_resume(tmp: str) -> dict:
    """Two epochs, saving in the background after each; then a fresh run resumes the first epoch's checkpoint."""
    watch = CompleteWhen(tmp + "/epoch0")
    whole = _async_fit(tmp, [SaveAtEpochEnd(tmp + "/epoch{epoch}"), watch])
    final = whole.strategy.full_state_dict()
    resumed = _async_fit(tmp, [], ckpt_path=f"{tmp}/epoch0")
    return {
        "final": final,
        "resumed": resumed.strategy.full_state_dict(),
        "step": resumed.global_step,
        "failure": _failed_background_write(tmp),
        "epoch0_complete": watch.seen,
    }


def _failed_background_write(tmp: str) -> str:
    """Rank 1's background write raises (its disk is full): the save's completion raises on every rank."""
    from lightning_shardlab.checkpoint import sharded_save as sharded

    def full_disk(obj: Any, path: Path) -> None:
        raise OSError(28, "No space left on device")

    write = full_disk if int(os.environ["RANK"]) == 1 else sharded.write_torch
    with mock.patch.object(sharded, "write_torch", write):  # undone after: the process serves more tests
        try:
            _async_fit(tmp, [SaveAtEpochEnd(tmp + "/failing")])
        except CheckpointError as err:
            return str(err)
    return "no error"


def test_an_async_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    out, other = run_ranks("tests.test_checkpoints_at_scale:async_resume", WORLD, {"tmp": str(tmp_path)}, timeout=200)
    assert out["step"] == 2 * STEPS_PER_EPOCH and out["final"].keys() == out["resumed"].keys()
    assert all(torch.equal(out["final"][k], out["resumed"][k]) for k in out["final"])
    # epoch 0's save was concluded by the first batch that began after every rank had written its files (one
    # all-reduce per batch while it is in flight), not left to the next save: complete within epoch 1
    assert any(out["epoch0_complete"]) and out["epoch0_complete"][-1], out["epoch0_complete"]
    for epoch in (0, 1):  # both complete: the end of fit concluded the last one
        assert CheckpointReader.open(tmp_path / f"epoch{epoch}").meta["world_size"] == WORLD
    for failure in (out["failure"], other["failure"]):  # every rank raised the same error, naming rank 1
        assert "rank 1 could not write its part" in failure and "No space left on device" in failure, failure
    assert not (tmp_path / "failing").exists()


def killed_during_background_write(tmp: str) -> dict:
    _async_fit(tmp, [SaveAtEpochEnd(f"{tmp}/ckpt", fail_on=(1, 2))])
    return {}


def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """Epoch 0's save completes (concluded when epoch 1's begins); rank 1 dies writing epoch 1's, in the
    background: every rank ends, and ``ckpt`` is still epoch 0's checkpoint, complete and verified."""
    kwargs = {"tmp": str(tmp_path)}
    target = "tests.test_checkpoints_at_scale:killed_during_background_write"
    results = run_ranks(target, WORLD, kwargs, timeout=200, expect_failure=True)
    assert all(code != 0 for code, _ in results), [code for code, _ in results]
    reader = CheckpointReader.open(tmp_path / "ckpt")
    reader.verify(reader.meta["files"])
    assert reader.load_trainer_state(None)["global_step"] == STEPS_PER_EPOCH
    assert unfinished_saves(tmp_path / "ckpt"), "the interrupted save's temporary directory"
    numel = reader.layouts[0].numel  # the reader fills a caller's buffer, and refuses a range no shard holds
    fresh = reader.read("master", 0, 0, numel)
    assert torch.equal(reader.read("master", 0, 0, numel, out=torch.full_like(fresh, float("nan"))), fresh)
    with pytest.raises(ValueError, match=f"is not inside its {numel} saved elements"):
        reader.read("master", 0, 0, numel + 1)
