"""The threads that move swap files' bytes for ``"nvme"`` offload, and what they measured: ``SwapIO``.

One reader and one writer thread per rank run the explicit reads and writes of Note [explicit swap I/O]
(``swap_file.py``): stage 3's parameter shards read ahead into gather buffers while the previous unit
computes, the optimizer's sub-groups read into fixed buffers while the previous one steps and written from
them while the next one steps (``swap_step.py``). ``os.preadv`` / ``os.pwritev`` and ``sync_file_range``
release the GIL, so the threads overlap the training thread's compute.

Note [I/O overlap]
    :class:`IOCounters` separates what the threads did from what the training thread waited for:
    ``read_s`` / ``write_s`` are the seconds the reader / writer spent in their calls (the I/O's cost), and
    ``wait_s`` the seconds the training thread spent blocked on a result it needed (the part of that cost
    that was not hidden behind compute). ``read_s + write_s - wait_s`` is the overlapped I/O; with
    everything overlapped ``wait_s`` is near 0. The bytes are those handed to the calls (what moved between
    the process and the files, page cache included); the disk's own traffic is Note [measured I/O]'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lightning_zero.core.offload.swap_file import SwapFile


@dataclass
class IOCounters:
    """Explicit swap I/O of one rank, cumulative over the run (Note [I/O overlap])."""

    bytes_read: int = 0  # bytes read from swap files into tensors
    bytes_written: int = 0  # bytes written from tensors into swap files
    reads: int = 0
    writes: int = 0
    read_s: float = 0.0  # seconds the reader thread spent reading
    write_s: float = 0.0  # seconds the writer thread spent writing (and waiting for the disk to take it)
    wait_s: float = 0.0  # seconds the training thread was blocked on reads or writes it needed


class SwapIO:
    """A reader and a writer thread for swap files (Note [I/O overlap])."""

    def __init__(self) -> None:
        self.counters = IOCounters()
        self._reader: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-read")
        self._writer: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-write")

    # ------------------------------------------------------------------ submitting
    def read(self, file: SwapFile, lo: int, dest: torch.Tensor) -> Future:
        """Read elements ``[lo, lo + dest.numel())`` of ``file`` into ``dest`` on the reader thread."""
        assert self._reader is not None, "swap I/O is closed"
        return self._reader.submit(self._timed_read, file, lo, dest)

    def write(self, file: SwapFile, lo: int, src: torch.Tensor, settle: bool = True,
              after: Callable[[], None] | None = None) -> Future:
        """Write ``src`` as elements ``[lo, lo + src.numel())`` of ``file`` on the writer thread; with ``settle``
        wait there until the disk has it and drop it from the page cache; then call ``after``."""
        assert self._writer is not None, "swap I/O is closed"
        return self._writer.submit(self._timed_write, file, lo, src, settle, after)

    def on_writer(self, fn: Callable[[], None]) -> Future:
        """Run ``fn`` on the writer thread, after the writes submitted before it."""
        assert self._writer is not None, "swap I/O is closed"
        return self._writer.submit(fn)

    def read_now(self, file: SwapFile, lo: int, dest: torch.Tensor) -> None:
        """Read on the calling thread (a read nothing can overlap), counted as waited for."""
        start = time.perf_counter()
        self._timed_read(file, lo, dest)
        self.counters.wait_s += time.perf_counter() - start

    def write_now(self, file: SwapFile, lo: int, src: torch.Tensor) -> None:
        """Write on the calling thread (its write-out to disk starts; the writer thread does not wait for it)."""
        start = time.perf_counter()
        self._timed_write(file, lo, src, False, None)
        self.counters.wait_s += time.perf_counter() - start

    # ------------------------------------------------------------------ waiting
    def wait(self, futures: Iterable[Future]) -> None:
        """Block until ``futures`` are done (re-raising their errors), counting the time as waited for."""
        start = time.perf_counter()
        try:
            for f in futures:
                f.result()
        finally:
            self.counters.wait_s += time.perf_counter() - start

    def drain(self) -> None:
        """Wait for every write submitted so far."""
        if self._writer is not None:
            self.wait([self._writer.submit(lambda: None)])

    def close(self) -> None:
        """Finish the submitted work and stop both threads."""
        for pool in (self._reader, self._writer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._reader = self._writer = None

    # ------------------------------------------------------------------ on the threads
    def _timed_read(self, file: SwapFile, lo: int, dest: torch.Tensor) -> None:
        start = time.perf_counter()
        n = file.read_into(lo, dest)
        c = self.counters
        c.read_s += time.perf_counter() - start
        c.bytes_read += n
        c.reads += 1

    def _timed_write(self, file: SwapFile, lo: int, src: torch.Tensor, settle: bool,
                     after: Callable[[], None] | None) -> None:
        start = time.perf_counter()
        n = file.write_from(lo, src)
        if settle:
            file.settle(lo, lo + src.numel())
        c = self.counters
        c.write_s += time.perf_counter() - start
        c.bytes_written += n
        c.writes += 1
        if after is not None:
            after()
