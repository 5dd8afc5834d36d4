"""The pieces of checkpointing that need no process group: per-rank side state and atomic files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_shardlab.checkpoint.atomic import (
    CheckpointError,
    check_file,
    clear_leftovers,
    commit,
    file_record,
    leftovers,
    remove_path,
)
from lightning_shardlab.checkpoint.rank_state import (
    ABSENT,
    Owners,
    SavedRankStates,
    differing_paths,
    get_or_absent,
    restore,
    tree_digests,
)


def _dump(rank: int) -> dict:
    """A Lightning-like dump as rank ``rank`` would make it."""
    return {
        "epoch": 3,
        "loops": {
            "fit_loop": {"state_dict": {"combined_loader": [{"position": 10 + rank}]}, "epoch_progress": {"n": 3}},
            "validate_loop": {"seen": rank},
        },
        "callbacks": {"Counter": {"mine": torch.tensor([rank, 1]), "shared": 5}, "Same": {"x": 1.5}},
        "state_dict": {"bn.running_mean": torch.full((3,), float(rank)), "bn.num_batches_tracked": torch.tensor(7)},
        "optimizer_states": [{"differs": rank}],  # never compared: sharded exactly elsewhere
        "tags": {"b", "a", "c"},  # a set of str: its iteration order differs between processes
        **({"only_on_rank_0": 1} if rank == 0 else {}),
    }


def test_differing_paths_are_the_outermost_entries_that_differ() -> None:
    paths = differing_paths([tree_digests(_dump(r)) for r in range(3)])
    assert paths == [
        ("loops", "fit_loop", "state_dict", "combined_loader"),
        ("loops", "validate_loop", "seen"),
        ("callbacks", "Counter", "mine"),
        ("state_dict", "bn.running_mean"),
        ("only_on_rank_0",),
    ]
    assert differing_paths([tree_digests(_dump(0))] * 2) == []


class Owner:
    def __init__(self, reshard: bool) -> None:
        if reshard:
            self.reshard_rank_state = lambda path, states, world_size, rank: (path, len(states), world_size, rank)


def _saved(world_size: int, broadcast_buffers: bool) -> SavedRankStates:
    dumps = [_dump(r) for r in range(world_size)]
    paths = differing_paths([tree_digests(d) for d in dumps])
    return SavedRankStates(world_size, paths, [[get_or_absent(d, p) for p in paths] for d in dumps], broadcast_buffers)


def test_same_world_size_gives_every_rank_its_own_values() -> None:
    checkpoint = _dump(0)
    restore(checkpoint, _saved(2, True), world_size=2, rank=1, owners=Owners(Owner(False)), source="ckpt")
    expected = _dump(1)
    assert checkpoint["loops"] == expected["loops"] and "only_on_rank_0" not in checkpoint
    assert torch.equal(checkpoint["callbacks"]["Counter"]["mine"], expected["callbacks"]["Counter"]["mine"])
    assert torch.equal(checkpoint["state_dict"]["bn.running_mean"], expected["state_dict"]["bn.running_mean"])


def test_another_world_size_reshards_explicitly_or_refuses() -> None:
    owners = Owners(Owner(True), datamodule=None, callbacks={"Counter": Owner(True)}, fn="fit")
    checkpoint = _dump(0)
    restore(checkpoint, _saved(2, True), world_size=3, rank=2, owners=owners, source="ckpt")
    assert checkpoint["callbacks"]["Counter"]["mine"] == (("mine",), 2, 3, 2)  # the path below the callback's entry
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == (
        ("loops", "fit_loop", "state_dict", "combined_loader"),
        2,
        3,
        2,
    )  # no datamodule: the module owns loops
    assert checkpoint["loops"]["validate_loop"]["seen"] == 0  # not restored when fitting: rank 0's
    assert checkpoint["state_dict"]["bn.running_mean"] == (("state_dict", "bn.running_mean"), 2, 3, 2)  # its hook
    # without hooks: buffers take rank 0's values (the run broadcast them), everything else is refused, by name
    owners = Owners(Owner(False), callbacks={"Counter": Owner(False)}, fn="fit")
    with pytest.raises(ValueError) as refused:
        restore(_dump(0), _saved(2, True), world_size=3, rank=1, owners=owners, source="ckpt")
    message = str(refused.value)
    assert "checkpoint['callbacks']['Counter']['mine'] (owner: Owner)" in message
    assert "checkpoint['loops']['fit_loop']['state_dict']['combined_loader']" in message
    assert "bn.running_mean" not in message and "validate_loop" not in message and "HINT:" in message
    assert "saved on 2 ranks" in message and "to 3 ranks" in message
    with pytest.raises(ValueError, match="bn.running_mean"):  # a run that did not broadcast buffers
        restore(_dump(0), _saved(2, False), world_size=3, rank=1, owners=owners, source="ckpt")
    assert ABSENT == _saved(2, True).values[1][-1]


def test_commit_replaces_atomically_and_remove_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "last.ckpt"
    for kind in ("dir", "file", "dir", "dir"):  # absent -> dir -> file -> dir -> dir
        tmp = tmp_path / f"{final.name}.tmp-{kind}"
        if kind == "dir":
            tmp.mkdir()
            (tmp / "COMPLETE").write_text(kind)
        else:
            tmp.write_text(kind)
        commit(tmp, final)
        assert not tmp.exists() and (final / "COMPLETE" if kind == "dir" else final).read_text() == kind
    link = tmp_path / "link.ckpt"
    link.symlink_to(final)
    tmp = tmp_path / "new"
    tmp.mkdir()
    commit(tmp, link)
    assert link.is_dir() and not link.is_symlink() and final.is_dir()  # the link replaced, its target untouched
    (tmp_path / "x.tmp-1").mkdir()
    stale = tmp_path / "last.ckpt.tmp-stale"
    stale.mkdir()
    assert leftovers(final) == [stale]
    clear_leftovers(final)
    assert leftovers(final) == [] and (tmp_path / "x.tmp-1").exists()
    remove_path(final)
    remove_path(link)
    assert sorted(os.listdir(tmp_path)) == ["x.tmp-1"]


def test_check_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "shard.pt"
    path.write_bytes(b"0123456789")
    record = file_record(path)
    check_file(path, record)
    path.write_bytes(b"0123456780")
    check_file(path, record, checksum=False)  # same size: only the checksum tells
    with pytest.raises(CheckpointError, match="shard.pt fails its sha256 check"):
        check_file(path, record)
    path.write_bytes(b"01234")
    with pytest.raises(CheckpointError, match="shard.pt has 5 bytes, but 10 were written"):
        check_file(path, record)
    path.unlink()
    with pytest.raises(CheckpointError, match="shard.pt is missing"):
        check_file(path, record)
