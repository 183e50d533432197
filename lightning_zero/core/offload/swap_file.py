"""The storage of ``"nvme"`` offload (Note [swap files] in ``file_store.py``): one run-private swap file (unlinked
as soon as it is created, its disk space reserved), read and written with explicit ``preadv`` / ``pwritev`` into
and out of tensors' memory (Note [explicit swap I/O]), and also mapped ``MAP_SHARED`` as a tensor for the uses
outside a training step (checkpoints, loading); and the removal of run directories that killed runs left."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
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


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` as a writable buffer (no copy; any dtype, bf16 too).
    The caller keeps ``t`` alive while the buffer is in use."""
    assert t.is_contiguous() and t.device.type == "cpu", "swap I/O needs a contiguous CPU tensor"
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)


class SwapFile:
    """One run-private, already-unlinked file of ``numel`` elements.

    Note [explicit swap I/O]
        A training step moves a swap file's bytes with :meth:`read_into` / :meth:`write_from`: ``preadv`` /
        ``pwritev`` straight between the file and a tensor's memory (a gather buffer, a fixed swap buffer),
        which release the GIL, so the reader and writer threads overlap them with compute. Nothing of the file
        is mapped into the process on that path: the pages read are clean page cache, which the kernel drops
        under a memory limit, and the pages written are made clean at once (:meth:`write_back` starts the
        write-out right after each write, and :meth:`settle` waits for it and drops them), so dirty page cache,
        which a memory cgroup charges and cannot drop until it is on disk, stays at what is in flight. The
        file is also mapped ``MAP_SHARED`` as :attr:`tensor`: checkpoints, loading and ``state_dict`` read and
        write it as an ordinary CPU tensor outside the step (the mapping and the explicit I/O share the page
        cache, so they see the same bytes); :meth:`release` takes such pages out of the process again.
    """

    def __init__(self, directory: str, numel: int, dtype: torch.dtype) -> None:
        fd, path = tempfile.mkstemp(prefix="swap-", dir=directory)
        os.unlink(path)  # Note [swap files]: gone at exit, never read again
        self.fd = fd
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(numel * self.itemsize, mmap.PAGESIZE)
        os.posix_fallocate(fd, 0, nbytes)  # reserve the disk space now: ENOSPC at setup, not mid-run
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        start = lo * self.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
        return start, hi * self.itemsize - start

    # ------------------------------------------------------------------ explicit I/O (Note [explicit swap I/O])
    def read_into(self, lo: int, dest: torch.Tensor) -> int:
        """Read elements ``[lo, lo + dest.numel())`` into ``dest`` (contiguous, this file's element size);
        returns the bytes."""
        view, offset = tensor_buffer(dest), lo * self.itemsize
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"swap file read stopped at byte {offset + done} of {offset + len(view)}")
            done += n
        return done

    def write_from(self, lo: int, src: torch.Tensor, write_back: bool = True) -> int:
        """Write ``src`` (contiguous, this file's element size) as elements ``[lo, lo + src.numel())`` and, with
        ``write_back``, start their write-out to disk (else :meth:`write_back` does later); returns the bytes."""
        view, offset = tensor_buffer(src), lo * self.itemsize
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        if write_back:
            self._sync_range(offset, len(view), _WRITE)
        return done

    def write_back(self, lo: int, hi: int) -> None:
        """Start writing elements ``[lo, hi)`` to disk (pages dirtied through the mapping, or written)."""
        self._sync_range(lo * self.itemsize, (hi - lo) * self.itemsize, _WRITE)

    def settle(self, lo: int, hi: int, drop: bool = True) -> None:
        """Wait until elements ``[lo, hi)`` are on disk; with ``drop`` also take them out of the page cache."""
        start, length = self._span(lo, hi)
        if length <= 0:
            return
        self._sync_range(start, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        if drop:
            os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)

    def _sync_range(self, offset: int, length: int, flags: int) -> None:
        if length <= 0:
            return
        if _SYNC_FILE_RANGE is None:  # not Linux: whole-file sync when waited for, nothing to start
            if flags & _WAIT_AFTER:
                os.fdatasync(self.fd)
            return
        if _SYNC_FILE_RANGE(self.fd, offset, length, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range on a swap file: {os.strerror(err)}")

    # ------------------------------------------------------------------ the mapping (outside a step)
    def release(self, lo: int, hi: int) -> int:
        """Take elements ``[lo, hi)`` of the mapping out of this process (they stay in the file) and start writing
        what was changed through it; returns the bytes."""
        start, length = self._span(lo, hi)
        if length > 0:
            self.map.madvise(mmap.MADV_DONTNEED, start, length)
            self._sync_range(start, length, _WRITE)
        return (hi - lo) * self.itemsize

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # tensors still view it: the mapping goes with them
            self.map.close()
        os.close(self.fd)
