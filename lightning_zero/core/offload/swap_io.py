"""The threads that move swap files' bytes for ``"nvme"`` offload, and what they measured: ``SwapIO``.

One reader and one writer thread per rank run the explicit reads and writes of Note [explicit swap I/O]
(``swap_file.py``): stage 3's parameter shards read ahead into gather buffers while the previous unit
computes, the optimizer's sub-groups read into fixed buffers while the previous one steps and written from
them while the next one steps (``swap_step.py``). ``os.preadv`` / ``os.pwritev`` and ``sync_file_range``
release the GIL, so the threads overlap the training thread's compute.

Note [bounded write-back]
    A write copies into the page cache and starts the write-out at once (``SwapFile.write_from``); the pages
    are then clean only once the disk has them. A memory cgroup charges dirty and in-flight pages and, under
    cgroup v1, has no write-back throttling of its own, so the writes still on their way are bounded here:
    every write is queued, and once more than :func:`write_behind_bytes` are queued the oldest are waited for
    by the thread that wrote (``SwapFile.settle``; the optimizer's state is also dropped from the page cache,
    as the next step reads it again from disk). The bound is 64 MiB, enough for the disk's queue, or less in a
    small memory cgroup: an eighth of the room it had when the offload started, since pages on their way
    cannot be reclaimed. Waiting for each write before the next one instead kept one write in the disk's
    queue at a time: a GPT-350M step wrote 2.1 GB per rank at 325 MB/s, against the disk's 1.7 GB/s
    (docs/benchmarks.md). :meth:`SwapIO.settle_all` (the end of an optimizer step) waits for all.

Note [I/O overlap]
    :class:`IOCounters` separates what the threads did from what the training thread waited for:
    ``read_s`` / ``write_s`` are the seconds the reader / writer spent in their calls (the I/O's cost), and
    ``wait_s`` the seconds the training thread spent blocked on a result it needed (the part of that cost
    that was not hidden behind compute). ``read_s + write_s - wait_s`` is the overlapped I/O; with
    everything overlapped ``wait_s`` is near 0. The bytes are those handed to the calls (what moved between
    the process and the files, page cache included); the disk's own traffic is Note [measured I/O]'s.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.stage3.memory_room import cgroup_pools

WRITE_BEHIND_BYTES = 64 << 20  # Note [bounded write-back]: bytes written and not yet waited for, per rank, at most


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


def write_behind_bytes() -> int:
    """Bytes of writes on their way to disk at most (Note [bounded write-back]): :data:`WRITE_BEHIND_BYTES`, or an
    eighth of the room of the tightest memory cgroup above this process, at least 4 MiB."""
    rooms = [pool.room for pool in cgroup_pools()]
    return max(4 << 20, min([WRITE_BEHIND_BYTES, *(room // 8 for room in rooms)]))


class SwapIO:
    """A reader and a writer thread for swap files (Note [I/O overlap])."""

    def __init__(self) -> None:
        self.counters = IOCounters()
        self.behind_limit = write_behind_bytes()
        self._reader: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-read")
        self._writer: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-write")
        self._behind: deque[tuple[SwapFile, int, int, bool]] = deque()  # Note [bounded write-back]
        self._behind_bytes = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ submitting
    def read(self, file: SwapFile, lo: int, dest: torch.Tensor) -> Future:
        """Read elements ``[lo, lo + dest.numel())`` of ``file`` into ``dest`` on the reader thread."""
        assert self._reader is not None, "swap I/O is closed"
        return self._reader.submit(self._timed_read, file, lo, dest)

    def write(self, file: SwapFile, lo: int, src: torch.Tensor, drop: bool = True,
              after: Callable[[], None] | None = None) -> Future:
        """Write ``src`` as elements ``[lo, lo + src.numel())`` of ``file`` on the writer thread (done once in the
        page cache: ``src`` may be reused then), then call ``after``; with ``drop`` the pages leave the page cache
        once the disk has them (Note [bounded write-back])."""
        assert self._writer is not None, "swap I/O is closed"
        return self._writer.submit(self._timed_write, file, lo, src, drop, after)

    def on_writer(self, fn: Callable[[], None]) -> Future:
        """Run ``fn`` on the writer thread, after the writes submitted before it."""
        assert self._writer is not None, "swap I/O is closed"
        return self._writer.submit(fn)

    def read_now(self, file: SwapFile, lo: int, dest: torch.Tensor) -> None:
        """Read on the calling thread (a read nothing can overlap), counted as waited for."""
        start = time.perf_counter()
        self._timed_read(file, lo, dest)
        self.counters.wait_s += time.perf_counter() - start

    def write_now(self, file: SwapFile, lo: int, src: torch.Tensor, drop: bool = False) -> None:
        """Write ``src`` on the calling thread (``src`` may be reused once it returns); it waits for the disk only
        when too much is on its way (Note [bounded write-back])."""
        start = time.perf_counter()
        self._timed_write(file, lo, src, drop, None)
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
        """Wait for every write submitted so far to be in the page cache (the files read back what it wrote)."""
        if self._writer is not None:
            self.wait([self._writer.submit(lambda: None)])

    def settle_all(self) -> None:
        """Wait for every write so far to be on disk (Note [bounded write-back])."""
        self.drain()
        start = time.perf_counter()
        self._settle_behind(0)
        self.counters.wait_s += time.perf_counter() - start

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

    def _timed_write(self, file: SwapFile, lo: int, src: torch.Tensor, drop: bool,
                     after: Callable[[], None] | None) -> None:
        start = time.perf_counter()
        n = file.write_from(lo, src)
        with self._lock:
            self._behind.append((file, lo, lo + src.numel(), drop))
            self._behind_bytes += n
        self._settle_behind(self.behind_limit)
        c = self.counters
        c.write_s += time.perf_counter() - start
        c.bytes_written += n
        c.writes += 1
        if after is not None:
            after()

    def _settle_behind(self, limit: int) -> None:
        """Wait for the oldest writes until at most ``limit`` bytes are on their way (Note [bounded write-back])."""
        while True:
            with self._lock:
                if self._behind_bytes <= limit or not self._behind:
                    return
                file, lo, hi, drop = self._behind.popleft()
                self._behind_bytes -= (hi - lo) * file.itemsize
            file.settle(lo, hi, drop)
