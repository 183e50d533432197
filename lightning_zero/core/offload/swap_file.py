"""The storage of ``"nvme"`` offload (Note [swap files] in ``file_store.py``): one run-private swap file
mapped as a tensor (unlinked as soon as it is created, its disk space reserved, mapped ``MAP_SHARED``, read
ahead and written out in element ranges), and the removal of run directories that killed runs left."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile

import torch

# <nvme_path>/lightning_zero-<pid>-r<rank>-<tempfile's random suffix>: one run's directory (host_store.py)
RUN_DIR = re.compile(r"lightning_zero-(\d+)-r\d+-[a-z0-9_]+")


def remove_stale_run_dirs(root: str) -> list[str]:
    """Remove the run directories under ``root`` that runs killed by a signal left behind; return their paths.

    Only directories named as :data:`RUN_DIR`, owned by this user, whose process no longer exists on this
    host, and empty (their swap files were unlinked when created: ``os.rmdir`` never removes contents).

    Args:
        root: an ``nvme_path``.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = RUN_DIR.fullmatch(entry.name)
        try:
            if (match is None or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(match.group(1)))):
                continue
            os.rmdir(entry.path)
        except OSError:  # not empty, or gone meanwhile (another rank removed it)
            continue
        removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class SwapFile:
    """One run-private, already-unlinked file of ``numel`` elements, mapped as a 1-D tensor."""

    def __init__(self, directory: str, numel: int, dtype: torch.dtype) -> None:
        fd, path = tempfile.mkstemp(prefix="swap-", dir=directory)
        os.unlink(path)  # Note [swap files]: gone at exit, never read again
        self.fd = fd
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(numel * self.itemsize, mmap.PAGESIZE)
        os.posix_fallocate(fd, 0, nbytes)  # reserve the disk space now: ENOSPC at setup, not mid-run
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        start = lo * self.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        return start, hi * self.itemsize - start

    def prefetch(self, lo: int, hi: int, scratch: bytearray) -> int:
        """Read elements ``[lo, hi)`` from disk into the page cache, in large sequential reads
        (the reader thread runs it; the mapping's first touch is then a minor fault); returns the bytes."""
        start, length = self._span(lo, hi)
        view = memoryview(scratch)
        end = start + length
        while start < end:
            n = os.preadv(self.fd, [view[: min(len(scratch), end - start)]], start)
            if n <= 0:
                break
            start += n
        return (hi - lo) * self.itemsize

    def release(self, lo: int, hi: int) -> int:
        """Take elements ``[lo, hi)`` out of this process (they stay in the file); returns the bytes."""
        start, length = self._span(lo, hi)
        if length > 0:
            self.map.madvise(mmap.MADV_DONTNEED, start, length)
        return (hi - lo) * self.itemsize

    def flush(self, lo: int, hi: int) -> None:
        """Write dirty pages to disk and drop ``[lo, hi)`` from the page cache (the writer thread runs it)."""
        start, length = self._span(lo, hi)
        os.fdatasync(self.fd)
        if length > 0:
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # tensors still view it: the mapping goes with them
            self.map.close()
        os.close(self.fd)
