"""The disk tier: tensors whose bytes live in files, memory-mapped, and given back to the disk after each use.

``FileTier.tensor`` reserves a file's blocks (``posix_fallocate``: a full disk is an ``OSError`` here, never a
``SIGBUS`` on a later write), maps it shared (``torch.from_file``: the storage owns the mapping) and unlinks
the file at once. The bytes stay on disk for as long as the mapping lives and the kernel frees them when the
process ends, however it ends: ``offload_dir`` is clean after every run, a killed one included.

The tensors are ordinary CPU tensors to everything else (optimizers, checkpoints, the guard). Their pages
count as file-backed memory, not anonymous memory, and ``release`` hands them back: write the dirty pages
(``msync``), unmap them from this process (``MADV_DONTNEED``) and drop them from the page cache
(``POSIX_FADV_DONTNEED``), so the next touch reads from disk. ``read_ahead`` asks the kernel to start reading a
tensor's pages in the background (``MADV_WILLNEED``) while the optimizer works on the one before it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_WILLNEED, MADV_DONTNEED, MS_SYNC = 3, 4, 4  # Linux's values (<sys/mman.h>)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = _LIBC.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_NAMES = itertools.count()


class OffloadSpaceError(OSError):
    """``offload_dir`` cannot hold what the layout needs."""


@dataclass(frozen=True)
class _File:
    fd: int  # kept open for posix_fadvise and fstat; the name is already unlinked
    ptr: int  # the mapping's first byte (page aligned)
    nbytes: int


class FileTier:
    """Memory-mapped tensors in files under ``directory`` (one file per tensor), for one process."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._files: dict[int, _File] = {}  # storage data_ptr -> its file

    def tensor(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D tensor of ``numel`` zeros whose bytes live in a new file (named for ``name`` while it is made)."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
        path = self.directory / f".shardlab-offload-{os.getpid()}-{next(_NAMES)}-{safe}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        except OSError as err:
            os.close(fd)
            raise OffloadSpaceError(
                err.errno,
                f"could not reserve {nbytes:,} bytes for {name} in offload_dir={str(self.directory)!r}:"
                f" {err.strerror}. HINT: free space there, or point offload_dir at a larger disk",
            ) from err
        finally:
            path.unlink(missing_ok=True)
        self._files[tensor.untyped_storage().data_ptr()] = _File(fd, tensor.data_ptr(), nbytes)
        return tensor

    def owns(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` (or the tensor it views) lives in one of this tier's files."""
        return tensor.untyped_storage().data_ptr() in self._files

    @property
    def nbytes(self) -> int:
        """Bytes held in files (what the layout asked for)."""
        return sum(f.nbytes for f in self._files.values())

    @property
    def page_bytes(self) -> int:
        """What writing every file back moves, in whole pages (the unit of the kernel's I/O)."""
        return sum(-(-f.nbytes // PAGE) * PAGE for f in self._files.values())

    @property
    def allocated_bytes(self) -> int:
        """Bytes the file system has allocated to the files (measured: ``fstat``'s blocks)."""
        return sum(os.fstat(f.fd).st_blocks * 512 for f in self._files.values())

    def _file(self, tensor: Tensor) -> _File | None:
        return self._files.get(tensor.untyped_storage().data_ptr())

    def release(self, tensors: list[Tensor]) -> None:
        """Write ``tensors``' files' dirty pages to disk and drop their pages from memory (theirs whole)."""
        for f in {id(f): f for f in map(self._file, tensors) if f is not None}.values():
            _call(_LIBC.msync, f.ptr, f.nbytes, MS_SYNC)
            _call(_LIBC.madvise, f.ptr, f.nbytes, MADV_DONTNEED)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def read_ahead(self, tensors: list[Tensor]) -> None:
        """Start reading ``tensors``' files into memory in the background (the kernel's read-ahead)."""
        for f in {id(f): f for f in map(self._file, tensors) if f is not None}.values():
            _call(_LIBC.madvise, f.ptr, f.nbytes, MADV_WILLNEED)

    def forget(self, tensor: Tensor) -> None:
        """``tensor``'s file is no longer used (its storage may still be alive until the last view goes)."""
        f = self._files.pop(tensor.untyped_storage().data_ptr(), None)
        if f is not None:
            os.close(f.fd)


def _call(fn: ctypes._CFuncPtr, ptr: int, nbytes: int, flag: int) -> None:
    if fn(ptr, nbytes, flag) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{fn.__name__} on offloaded memory failed: {os.strerror(errno)}")


def drop_pages(tensor: Tensor) -> None:
    """Unmap from this process the whole pages inside ``tensor``'s bytes; touched again, they are read back from
    their file. Only for a tensor that views a file mapping (``torch.load(mmap=True)``) and was only read:
    the pages of anonymous memory, or of a mapping written to, would lose their contents."""
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if end > start:
        _call(_LIBC.madvise, start, end - start, MADV_DONTNEED)
