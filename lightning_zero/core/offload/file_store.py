"""The file store (``"nvme"``): an offloaded optimizer shard in run-private swap files, stepped in sub-groups.

:class:`FileStore` is the :class:`~lightning_zero.core.offload.shard_store.ShardStore` of
``optimizer_device="nvme"``: a :class:`~lightning_zero.core.offload.host_store.HostStore` whose masters
and per-element state are views of swap files, read ahead and written behind around each sub-group.

Note [swap files]
    Each (flat group, state key) has one file under a directory private to the run
    (``<nvme_path>/lightning_zero-<pid>-r<rank>-<random>``). It is unlinked as soon as it is opened, so
    it disappears when the process exits, however it exits, and no later run can ever read it as
    state. A run killed by a signal leaves its empty directory; the next run to start there removes
    those of this user whose process is gone (``remove_stale_run_dirs``). The file is mapped
    ``MAP_SHARED``; tensors are views of the mapping, so the optimizer,
    checkpoints and ``state_dict`` see ordinary CPU tensors. Stepping walks sub-groups of at most
    ``sub_group_size`` elements: while sub-group k steps, a reader thread reads sub-group k+1
    into the page cache with large ``os.preadv`` calls; after k stepped, its pages leave the process
    (``MADV_DONTNEED``: dirty pages stay in the page cache) and a writer thread writes them to disk
    (``fdatasync``) and drops them from the page cache (``POSIX_FADV_DONTNEED``) while the next
    sub-group steps. Only about two sub-groups are ever resident. State the optimizer creates
    lazily (at its first step, or loaded from a checkpoint) is moved into the files right after.
    The mapping was measured against threads over ``os.preadv``/``os.pwritev`` into a window of
    buffers (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.host_store import HostStore
from lightning_zero.core.offload.shard_store import SubGroup
from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.settings.offload import OffloadConfig

if TYPE_CHECKING:
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit


def process_io() -> tuple[int, int] | None:
    """Note [measured I/O]
        ``bytes_read`` / ``bytes_written`` are what the kernel accounted to this process (all its
        threads: the reader and writer threads too) as read from and sent to the storage layer
        (``read_bytes`` / ``write_bytes`` of ``/proc/self/io``) while the offloaded steps ran: pages
        served from the page cache count nothing, pages dirtied through the swap files' mappings count
        when dirtied. They are the disk traffic of the swap files, not the sizes of the ranges handed
        to the I/O threads (a file system in memory, such as tmpfs, reads and writes nothing). Where
        ``/proc/self/io`` cannot be read this returns ``None`` and the two counters stay 0.
    """
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class FileStore(HostStore):
    """This rank's optimizer shards in swap files (``"nvme"``; Note [swap files]).

    Args: as :class:`HostStore`'s.
    """

    device = OffloadDevice.nvme
    nvme = True

    def __init__(self, config: OffloadConfig, rank: int = 0, units: list[ShardedUnit] | None = None) -> None:
        super().__init__(config, rank, units)
        self.files: dict[tuple[int, str], SwapFile] = {}
        self._reader: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-read")
        self._reading: dict[int, list[Future]] = {}  # sub-group index -> its reads in flight
        self._scratch = bytearray(16 << 20)

    def new_master(self, fi: int, own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The swap file of the master of flat group ``fi`` (the caller fills it)."""
        return self._file(fi, "master", own.numel(), dtype).tensor

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        file = self.files.get((fi, "master"))
        return None if file is None else (lambda lo, hi: file.release(lo, hi) and None)

    def _file(self, fi: int, key: str, numel: int, dtype: torch.dtype) -> SwapFile:
        file = self.files.get((fi, key))
        if file is None:
            assert self.directory is not None
            file = self.files[(fi, key)] = SwapFile(self.directory.name, numel, dtype)
        return file

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The gradient itself when it is a host tensor of the master's dtype, else a host buffer's copy."""
        if grad.device.type == "cpu" and grad.dtype == master.dtype:
            return grad
        return super().receive_grad(fi, grad, master)

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        """The view of elements ``[lo, lo + tensor.numel())`` of the swap file of state ``key`` of flat
        group ``fi`` (``numel`` elements in all), holding ``tensor``'s values; ``tensor`` when it is that view."""
        view = self._file(fi, key, numel, tensor.dtype).tensor[lo : lo + tensor.numel()]
        if view.data_ptr() != tensor.data_ptr():
            view.copy_(tensor.reshape(-1))
        return view.view(tensor.shape)

    # ------------------------------------------------------------------ step
    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        """Split the masters (``numels`` elements each) into runs of at most ``sub_group_size``
        elements (at least one piece each), at piece boundaries."""
        limit = max(self.config.sub_group_size, 1)
        out: list[SubGroup] = []
        current: SubGroup = []
        size = 0
        for fi, n in enumerate(numels):
            for lo in range(0, n, piece):
                hi = min(lo + piece, n)
                if current and size + hi - lo > limit:
                    out.append(current)
                    current, size = [], 0
                if current and current[-1][0] == fi and current[-1][2] == lo:
                    current[-1] = (fi, current[-1][1], hi)
                else:
                    current.append((fi, lo, hi))
                size += hi - lo
        return out + ([current] if current else [])

    def _io(self) -> tuple[int, int] | None:
        return process_io()  # Note [measured I/O]

    def _before_sub_group(self, k: int, sub_groups: list[SubGroup]) -> None:
        """Read sub-group ``k`` (the first) and ``k + 1`` ahead; wait for ``k``'s reads."""
        if k == 0:
            self._prefetch(0, sub_groups[0])
        if k + 1 < len(sub_groups):
            self._prefetch(k + 1, sub_groups[k + 1])
        for f in self._reading.pop(k, []):
            f.result()

    def _after_sub_group(self, sg: SubGroup) -> None:
        """Take ``sg``'s pages out of the process; the writer thread writes them to disk."""
        for (fi, _key), file in self.files.items():
            for gi, lo, hi in sg:
                if gi == fi:
                    file.release(lo, hi)
                    assert self._writer is not None
                    self._pending.append(self._writer.submit(file.flush, lo, hi))

    def _prefetch(self, k: int, sg: SubGroup) -> None:
        assert self._reader is not None
        for (fi, _key), file in self.files.items():
            for gi, lo, hi in sg:
                if gi == fi:
                    self._reading.setdefault(k, []).append(self._reader.submit(file.prefetch, lo, hi, self._scratch))

    def release_all(self) -> None:
        for file in self.files.values():
            file.release(0, file.tensor.numel())
        super().release_all()

    def close(self) -> None:
        """Stop the threads, close the swap files and remove the run's directory (also done at exit)."""
        self._stop_writer()
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
        for file in self.files.values():
            file.close()
        self.files.clear()
        super().close()
