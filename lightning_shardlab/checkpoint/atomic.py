"""Files that are either complete or absent: atomic commit, durable writes, sizes and checksums.

Nothing here communicates. A checkpoint (a file or a directory) is written under a temporary name
beside its destination, ``<name>.tmp-<id>``, flushed to disk (``fsync`` of every file and of the
directory), and only then moved into place in one step:

- destination absent: ``rename(2)``, atomic on POSIX file systems;
- destination present (re-saving ``last.ckpt``, or a directory replacing a file): Linux's
  ``renameat2(RENAME_EXCHANGE)`` swaps the two names atomically, then the old one is deleted. Where the
  call or the file system lacks it, the old one is first renamed aside to ``<name>.old-<id>``: a crash
  between the two renames leaves the destination missing but the old checkpoint whole under that name.

So a crash, a killed rank or a full disk leaves at most a ``<name>.tmp-<id>`` (never a half-written
``<name>``), and the next save of the same destination deletes such leftovers. Removal is the same in
reverse: rename aside, then delete, so a checkpoint never exists half-deleted under its own name.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

HASH = "sha256"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_CHUNK = 1 << 20  # bytes read at a time when hashing


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete, corrupt, or could not be written. The message names the file."""


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def tmp_path(final: Path, tmp_id: str) -> Path:
    """Where a checkpoint is written before it is moved to ``final``."""
    return final.with_name(f"{final.name}.tmp-{tmp_id}")


def leftovers(final: Path, keep: frozenset[Path] = frozenset()) -> list[Path]:
    """Unfinished saves (``<name>.tmp-*``, and a sharded save's ``<name>.shards-*`` that no model file names:
    checkpoint/model_file.py) and interrupted replacements (``<name>.old-*``) of ``final``, but for ``keep``."""
    if not final.parent.is_dir():
        return []
    patterns = (".tmp-*", ".old-*", ".shards-*")
    found = {p for pattern in patterns for p in final.parent.glob(f"{glob_escape(final.name)}{pattern}")}
    return sorted(found - keep)


def glob_escape(name: str) -> str:
    # checkpoint names like "epoch=1-step=8.ckpt" are safe, but "[...]" would be a glob class
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def file_record(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in chunks (nothing held in memory)."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, HASH: digest.hexdigest()}


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_torch(obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``path``, flush it to disk, return its file record."""
    torch.save(obj, path)
    fsync_file(path)
    return file_record(path)


def write_json(obj: Any, path: Path) -> dict[str, Any]:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return file_record(path)


def check_file(path: Path, expected: dict[str, Any], checksum: bool = True) -> None:
    """Raise ``CheckpointError`` naming ``path`` unless it exists with the recorded size (and checksum)."""
    hint = "HINT: the checkpoint was damaged after it was written; resume from another checkpoint."
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing. {hint}")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, but {expected['bytes']} were written (truncated or"
            f" altered). {hint}"
        )
    if checksum:
        digest = file_record(path)[HASH]
        if digest != expected[HASH]:
            raise CheckpointError(
                f"checkpoint file {path} fails its {HASH} check: {digest[:16]}... is not the {expected[HASH][:16]}..."
                f" recorded when it was written (its bytes were altered). {hint}"
            )


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux ``renameat2``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(code, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(code)}")


def delete(path: Path) -> None:
    """Delete a file, a link or a directory tree (whatever ``path`` is)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` to ``final`` in one step, replacing whatever ``final`` was."""
    if not (final.exists() or final.is_symlink()):
        os.rename(tmp, final)
    elif tmp.is_file() and final.is_file() and not final.is_symlink():
        os.replace(tmp, final)
    elif _exchange(tmp, final):
        delete(tmp)  # now the old checkpoint
    else:
        aside = final.with_name(f"{final.name}.old-{new_id()}")
        os.rename(final, aside)
        os.rename(tmp, final)
        delete(aside)
    fsync_dir(final.parent)


def remove_path(path: Path) -> None:
    """Remove a checkpoint so that it is never seen half-deleted under its own name."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        aside = path.with_name(f"{path.name}.old-{new_id()}")
        os.rename(path, aside)
        delete(aside)
    fsync_dir(path.parent)


def clear_leftovers(final: Path, keep: frozenset[Path] = frozenset()) -> None:
    """Delete unfinished saves of ``final`` but for ``keep`` (a save of the same destination is starting)."""
    for path in leftovers(final, keep):
        delete(path)


def same_destination(paths: list[str], action: str) -> None:
    if len(set(paths)) > 1:
        raise ValueError(
            f"ranks were asked to {action} different checkpoints: {sorted(set(paths))}. HINT: pass the"
            " same path on every rank (e.g. compute it on rank 0 and broadcast it)."
        )
