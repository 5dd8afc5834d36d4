"""Checkpoints across world sizes and stages, consolidation, and ``shardlab inspect``.

One chain of runs on GroupedGPT (tied embedding, a frozen block, two param groups, a warm-up schedule):

    A  = 2 ranks, stage 3, 1 epoch                 (saved)
    A -> 1 rank,  stage 3, to epoch 2
    A -> 3 ranks, stage 1, to epoch 2 -> B3        (first refused: per-rank side state without a resharder)
    A -> 4 ranks, stage 2, to epoch 2 -> B4
    B3, B4 -> 2 ranks, stage 3, to epoch 3

Every load must reproduce the saved weights and optimizer state bit for bit (gathered when training
starts), and every continuation must match an unsharded reference that starts from the consolidated
checkpoint and trains on the same global batches. The global batch (12) is the same at every world size.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.testing import assert_close

from lightning_shardlab import ShardLabStrategy
from lightning_shardlab.checkpoint.consolidate import consolidate
from lightning_shardlab.checkpoint.describe import describe
from lightning_shardlab.checkpoint.format import shards_of
from tests.helpers.launch import run_commands, run_ranks
from tests.helpers.reference import FP32
from tests.models import GroupedGPT, OrderedData, RegressionNet, global_batches, regression_dataset, token_dataset
from tests.test_checkpoint import QUIET, RankTally, Snapshot, differences, snapshot

GLOBAL_BATCH, STEPS_PER_EPOCH = 12, 2
TOKENS = int(token_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH).tensors[0].sum())  # what one epoch adds to the tallies


class Tally(RankTally):
    """RankTally whose per-rank token sums can be resharded: the new rank 0 takes the saved ranks' total."""

    @property
    def state_key(self) -> str:
        return "Tally"

    def reshard_rank_state(self, path: tuple, states: list, world_size: int, rank: int) -> Any:
        assert path == ("token_sum",), path
        return sum(states) if rank == 0 else 0


class UnreshardableTally(RankTally):
    @property
    def state_key(self) -> str:
        return "Tally"


def _data(world_size: int) -> OrderedData:
    return OrderedData(token_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH), GLOBAL_BATCH // world_size)


def _trainer(world_size: int, stage: int, epochs: int, callbacks: list, **options: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ShardLabStrategy(stage=stage, **options),
        max_epochs=epochs,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=callbacks,
        **QUIET,
    )


def save_first(tmp: str) -> dict:
    torch.manual_seed(0)
    tally = Tally()
    trainer = _trainer(2, 3, 1, [tally])
    trainer.fit(GroupedGPT(), _data(2))
    trainer.save_checkpoint(Path(tmp) / "A")
    return {"saved": snapshot(trainer), "token_sum": tally.token_sum}


def load_and_continue(
    world_size: int, stage: int, src: str, epochs: int, save_to: str | None = None, refuse_first: bool = False
) -> dict:
    """Resume ``src`` on this world size and stage; optionally save after. With ``refuse_first``, first try
    with a callback whose per-rank state cannot be resharded, and report the error."""
    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    if refuse_first:
        try:
            _trainer(world_size, stage, epochs, [UnreshardableTally()]).fit(
                GroupedGPT(), _data(world_size), ckpt_path=src
            )
            out["refused"] = None
        except ValueError as err:
            out["refused"] = str(err)
    torch.manual_seed(world_size)  # other initial weights: the checkpoint must win
    tally, at_start = Tally(), Snapshot()
    trainer = _trainer(world_size, stage, epochs, [tally, at_start])
    trainer.fit(GroupedGPT(), _data(world_size), ckpt_path=src)
    if save_to:
        trainer.save_checkpoint(save_to)
    out.update(
        {
            "loaded": at_start.at_start,
            "final": snapshot(trainer),
            "token_sum": tally.token_sum,
            "batches": tally.batches,
        }
    )
    return out


def load_many(world_size: int, stage: int, srcs: list[str], epochs: int) -> list[dict]:
    return [load_and_continue(world_size, stage, src, epochs) for src in srcs]


def reference_continuation(consolidated: dict, epochs: int) -> dict:
    """Unsharded: load the consolidated checkpoint into a plain GroupedGPT, AdamW and LambdaLR, and train
    ``epochs`` more epochs on the same global batches."""
    model = GroupedGPT()
    model.load_state_dict(consolidated["state_dict"], strict=True)
    config = model.configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    optimizer.load_state_dict(consolidated["optimizer_states"][0])
    schedule.load_state_dict(consolidated["lr_schedulers"][0])
    dataset = token_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH)
    for _ in range(epochs):
        for batch in global_batches(dataset, GLOBAL_BATCH, 1):
            optimizer.zero_grad()
            model.gpt.loss(batch).backward()
            optimizer.step()
            schedule.step()
    return {"state": model.state_dict(), "optim": [optimizer.state_dict()]}


def assert_matches_reference(final: dict, reference: dict) -> None:
    assert list(final["state"]) == list(reference["state"])
    for key, value in reference["state"].items():
        assert_close(final["state"][key], value, **FP32, msg=key)
    for j, state in reference["optim"][0]["state"].items():
        for key, value in state.items():
            # moments sum gradients reduced in another order: fp32 noise, measured below 5e-7 of each
            # tensor's largest value; a misplaced slice would be off by the order of that value
            atol = 1e-5 * float(value.abs().max()) if value.dim() else 0.0
            assert_close(final["optim"][0]["state"][j][key], value, rtol=1.3e-6, atol=atol, msg=f"{j} {key}")


@pytest.fixture(scope="module")
def checkpoint_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A: GroupedGPT after one epoch on 2 ranks at stage 3, and what each rank saw when saving it."""
    tmp = tmp_path_factory.mktemp("reshard")
    return tmp / "A", run_ranks("tests.test_checkpoint_reshard:save_first", 2, {"tmp": str(tmp)}, timeout=120)


def test_reshard_across_world_sizes_and_stages(checkpoint_a: tuple[Path, list[dict]], tmp_path: Path) -> None:
    tmp = str(tmp_path)
    a, first = str(checkpoint_a[0]), checkpoint_a[1]
    saved = first[0]["saved"]
    # consolidation in this one process equals the live weights and optimizer state, bit for bit
    consolidated = consolidate(a, tmp_path / "A.ckpt")
    assert list(consolidated["state_dict"]) == list(GroupedGPT().state_dict())  # the module's own keys, in order
    assert differences(consolidated["state_dict"], saved["state"]) == []
    assert differences(consolidated["optimizer_states"], saved["optim"]) == []
    reference = reference_continuation(consolidated, 1)

    one = run_ranks(
        "tests.test_checkpoint_reshard:load_and_continue",
        1,
        {"world_size": 1, "stage": 3, "src": a, "epochs": 2},
        timeout=120,
    )
    three = run_ranks(
        "tests.test_checkpoint_reshard:load_and_continue",
        3,
        {"world_size": 3, "stage": 1, "src": a, "epochs": 2, "save_to": f"{tmp}/B3", "refuse_first": True},
        timeout=180,
    )
    four = run_ranks(
        "tests.test_checkpoint_reshard:load_and_continue",
        4,
        {"world_size": 4, "stage": 2, "src": a, "epochs": 2, "save_to": f"{tmp}/B4"},
        timeout=240,
    )
    for run in (one, three, four):
        assert differences(run[0]["loaded"], saved) == []  # weights, moments, steps, param groups: exact
        assert_matches_reference(run[0]["final"], reference)  # and training goes on as unsharded training does
        # the explicit resharder of the per-rank token sums moved the saved total to rank 0: nothing lost,
        # nothing counted twice (each epoch adds every token once)
        assert sum(r["token_sum"] for r in run) == 2 * TOKENS
        assert all(r["batches"] == 2 * STEPS_PER_EPOCH for r in run)
    # without a resharder, per-rank state is refused on every rank with the same message, naming the entry
    messages = {r["refused"] for r in three}
    assert len(messages) == 1 and None not in messages, messages
    message = messages.pop()
    assert "checkpoint['callbacks']['Tally']['token_sum']" in message and "HINT:" in message
    assert "saved on 2 ranks" in message and "3 ranks" in message

    back = run_ranks(
        "tests.test_checkpoint_reshard:load_many",
        2,
        {"world_size": 2, "stage": 3, "srcs": [f"{tmp}/B3", f"{tmp}/B4"], "epochs": 3},
        timeout=180,
    )
    for i, (source, name) in enumerate(((three, "B3"), (four, "B4"))):  # 3 -> 2 (stage 1 -> 3), 4 -> 2 (2 -> 3)
        run = [back[r][i] for r in range(2)]
        assert differences(run[0]["loaded"], source[0]["final"]) == []
        assert sum(r["token_sum"] for r in run) == 3 * TOKENS
        reference = reference_continuation(consolidate(f"{tmp}/{name}", f"{tmp}/{name}.ckpt"), 1)
        assert_matches_reference(run[0]["final"], reference)


def test_consolidated_checkpoint_loads_without_this_package(
    checkpoint_a: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    a = checkpoint_a[0]
    dst = tmp_path / "plain.ckpt"
    code = (  # plain torch reads the file: no class of this package is in it, and nothing of it is imported
        "import sys, torch\n"
        f"ckpt = torch.load({str(dst)!r}, weights_only=True)\n"
        f"own = torch.load({str(a)!r}, weights_only=True)\n"  # the sharded checkpoint's path itself, too
        "assert all(torch.equal(v, own['state_dict'][k]) for k, v in ckpt['state_dict'].items())\n"
        "assert not any(m.startswith('lightning_shardlab') for m in sys.modules), 'imported lightning_shardlab'\n"
        "print('plain load ok', len(ckpt['state_dict']))\n"
    )
    run_commands([[sys.executable, "-m", "lightning_shardlab.cli", "consolidate", str(a), str(dst)]], timeout=120)
    (output,) = run_commands([[sys.executable, "-c", code]], timeout=120)
    assert "plain load ok" in output
    # ... and Lightning's own loader restores the module from it, strictly
    model = GroupedGPT.load_from_checkpoint(dst, map_location="cpu", strict=True)
    ckpt = torch.load(dst, weights_only=True)
    assert list(ckpt["state_dict"]) == list(model.state_dict())
    assert all(torch.equal(v, ckpt["state_dict"][k]) for k, v in model.state_dict().items())
    # the sharded checkpoint's own path loads the same way, in this plain process, to the same values
    direct = GroupedGPT.load_from_checkpoint(a, map_location="cpu", strict=True)
    assert all(torch.equal(v, ckpt["state_dict"][k]) for k, v in direct.state_dict().items())
    # shardlab inspect: stage, world size, units, bytes per rank, and where every parameter lives
    info = describe(a, verify=True)
    assert info["problems"] == [] and info["verified"]
    assert (info["world_size"], info["stage"], info["precision"]) == (2, 3, "32-true")
    for rank in info["per_rank"]:
        assert rank["bytes"] == sum((shards_of(a) / name).stat().st_size for name in rank["files"]) > 0
    assert set(info["units"]) == {"root"}  # three small blocks, fewer than unit_bucket_params: no units of their own
    frozen = [fp for fp in info["units"]["root"] if "frozen" in fp["flat_param"]]
    assert frozen and frozen[0]["tensors"] == ["master"]  # a frozen flat parameter has no optimizer state
    shapes = {name: list(p.shape) for name, p in GroupedGPT().named_parameters()}
    assert {p["name"]: p["shape"] for p in info["parameters"]} == shapes
    for p in info["parameters"]:  # the ranks' element ranges tile the parameter exactly
        ranges = [(a, b) for _, a, b in p["ranks"]]
        assert ranges[0][0] == 0 and ranges[-1][1] == torch.Size(p["shape"]).numel()
        assert all(b == a2 for (_, b), (a2, _) in zip(ranges, ranges[1:]))


# ---- odd shapes: one-element units, so some ranks hold nothing but padding; SGD with momentum ----


def _fit_regression(world_size: int, stage: int, epochs: int, src: str | None, save_to: str | None) -> dict:
    torch.manual_seed(world_size)
    at_start = Snapshot()
    trainer = _trainer(world_size, stage, epochs, [at_start], unit_bucket_params=0)  # one-element gate units
    trainer.fit(
        RegressionNet("sgd"), OrderedData(regression_dataset(GLOBAL_BATCH), GLOBAL_BATCH // world_size), ckpt_path=src
    )
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"loaded": at_start.at_start, "final": snapshot(trainer)}


def test_reshard_with_padding_and_empty_shards(tmp_path: Path) -> None:
    """OddNet (7, 15, 17, a size-1 layer, two one-element gate units): 3 ranks stage 3 -> 4 ranks stage 1.
    Ranks that hold only padding write empty slices and read what their new shard needs."""
    r3 = str(tmp_path / "R3")
    (three,) = run_ranks(
        "tests.test_checkpoint_reshard:_fit_regression",
        3,
        {"world_size": 3, "stage": 3, "epochs": 1, "src": None, "save_to": r3},
        timeout=120,
    )[:1]
    gate = describe(r3)["parameters"]
    assert [p["ranks"] for p in gate if p["name"] == "net.gates.1.scale"] == [[[0, 0, 1]]]  # ranks 1, 2: padding
    (four,) = run_ranks(
        "tests.test_checkpoint_reshard:_fit_regression",
        4,
        {"world_size": 4, "stage": 1, "epochs": 2, "src": r3, "save_to": None},
        timeout=180,
    )[:1]
    assert differences(four["loaded"], three["final"]) == []
    consolidated = consolidate(r3, tmp_path / "R3.ckpt")
    model = RegressionNet("sgd")
    model.load_state_dict(consolidated["state_dict"], strict=True)
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(consolidated["optimizer_states"][0])
    x, y = regression_dataset(GLOBAL_BATCH).tensors
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model.net(x), y).backward()
    optimizer.step()
    assert_matches_reference(four["final"], {"state": model.state_dict(), "optim": [optimizer.state_dict()]})
