"""Stage-3 parameter offload: where each rank's parameter shards live (``"cpu"`` buffers or ``"nvme"`` files).

Note [parameter offload]
    At stage 3 a released unit exists on this rank only as ``FlatParamGroup.shard``, one 1-D shard
    per flat group. With ``offload_param`` those shards are moved once, at setup, into storage of
    their own: ``"cpu"``, a host buffer per shard (pinned when ``pin_memory`` and an accelerator);
    ``"nvme"``, a view of a run-private swap file per shard (``SwapFile``, Note [swap files] in
    ``file_store.py``: unlinked at once, space reserved, never read as state after a crash).
    The persistent unit (parameters below ``param_persistence_threshold``) stays whole with the
    module, as it is gathered every step anyway.

    In: ``ShardedUnit.start_gather`` hands the copy of the shard into the unit's gather buffer to
    :meth:`ParamOffload.read` (the hook ``ShardedUnit.shard_io``). Stage 3's prefetch starts the
    gathers of the next units while the current one computes, so the read of a prefetched unit is
    issued ahead of its use, not when it runs. With ``"nvme"`` the copy faults the file's pages in,
    which are released from the process right after (``MADV_DONTNEED``), and the kernel is asked to
    read ahead the shards of the neighbouring units (index +-1: the next unit in forward and in
    backward; ``POSIX_FADV_WILLNEED``, asynchronous), so that the prefetch finds them in the page cache.

    Out: the optimizer's store (``HostStore.write_back``) casts each stepped master range into
    the shard and calls :meth:`ParamOffload.written`; with ``"nvme"`` those pages leave the process
    at once, and at the end of the step the writer thread writes the files to disk and drops them
    from the page cache (as for the optimizer's swap files). Reads and writes outside a step (a
    checkpoint, ``gathered_parameters``, loading) touch the same views; :meth:`release_all` takes
    them out of the process again.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.offload.swap_file import SwapFile

if TYPE_CHECKING:
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit


@dataclass
class ParamOffloadCounters:
    """Parameter-shard traffic, cumulative over the run (tests and benchmarks read these)."""

    bytes_in: int = 0  # shard bytes brought into gather buffers
    bytes_out: int = 0  # stepped bytes written into the offloaded shards
    shards: int = 0  # offloaded shards (flat groups of non-persistent units)
    shard_bytes: int = 0  # their total size


class ParamOffload:
    """The offloaded parameter shards of this rank's stage-3 units (Note [parameter offload]).

    Args:
        device: :attr:`OffloadDevice.cpu` or :attr:`OffloadDevice.nvme` (or its string, ``"cpu"`` / ``"nvme"``).
        units: the engine's units; all but the persistent one are offloaded.
        directory: the run's private swap directory (``"nvme"``).
        pin: pin the host buffers (``"cpu"``; only with an accelerator).
    """

    def __init__(self, device: OffloadDevice | str, units: list[ShardedUnit], directory: str | None,
                 pin: bool = False) -> None:
        if device not in (OffloadDevice.cpu, OffloadDevice.nvme):
            raise ValueError(f"param offload device must be 'cpu' or 'nvme', not {device!r}.")
        self.device = OffloadDevice(device)
        self.nvme = self.device is OffloadDevice.nvme
        self.pin = pin and not self.nvme
        self.counters = ParamOffloadCounters()
        self.fence = CopyFence()  # pinned shard -> device copies in flight (Note [asynchronous host copies])
        self.units = [u for u in units if not u.persistent]
        self.files: dict[int, SwapFile] = {}  # id(flat group) -> its swap file
        self.offloaded: set[int] = {id(g) for u in self.units for g in u.groups}
        self.homes: dict[int, torch.Tensor] = {}  # id(flat group) -> the storage its shard lives in
        self._neighbours: dict[int, list[FlatParamGroup]] = {}  # id(flat group) -> groups to read ahead
        for i, unit in enumerate(self.units):
            for g in unit.groups:
                g.shard = self.homes[id(g)] = self._home(g, directory)
                self.counters.shards += 1
                self.counters.shard_bytes += g.shard.numel() * g.shard.element_size()
            near = [u for u in self.units[max(i - 1, 0) : i + 2] if u is not unit]
            for g in unit.groups:
                self._neighbours[id(g)] = [n for u in near for n in u.groups]
            unit.shard_io = self
            # stage 3 at world size 1 may lend a shard's memory to the gather buffer instead of copying it
            # (``ShardedUnit.lend``, issue 21's speed items): never an offloaded shard, whose storage is the store's
            unit.lend = False

    @torch.no_grad()
    def _home(self, g: FlatParamGroup, directory: str | None) -> torch.Tensor:
        assert g.shard is not None, "param offload needs the units sharded first"
        if not self.nvme:
            return torch.empty(g.shard.numel(), dtype=g.shard.dtype, pin_memory=self.pin).copy_(g.shard)
        assert directory is not None
        file = self.files[id(g)] = SwapFile(directory, g.shard.numel(), g.shard.dtype)
        file.tensor.copy_(g.shard)
        file.release(0, g.shard.numel())
        return file.tensor

    # ------------------------------------------------------------------ the hooks
    def read(self, g: FlatParamGroup, dest: torch.Tensor) -> None:
        """Copy this rank's shard of ``g`` into ``dest`` (its range of the gather buffer)."""
        assert g.shard is not None
        dest.copy_(g.shard, non_blocking=self.pin)
        self.fence.record(id(g), self.pin, g.shard, dest)  # before_write(g) waits for it
        self.counters.bytes_in += g.shard.numel() * g.shard.element_size()
        file = self.files.get(id(g))
        if file is not None:
            file.release(0, g.shard.numel())
            for n in self._neighbours[id(g)]:
                other = self.files[id(n)]
                os.posix_fadvise(other.fd, 0, other.tensor.numel() * other.itemsize, os.POSIX_FADV_WILLNEED)

    def before_write(self, g: FlatParamGroup) -> None:
        """Before the CPU overwrites ``g``'s shard: the device has finished reading it (Note
        [asynchronous host copies] in copy_fence.py)."""
        self.fence.wait(id(g))

    def written(self, g: FlatParamGroup, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of ``g``'s shard were just written by the optimizer's write-back."""
        if id(g) not in self.offloaded or g.shard is None:
            return  # the persistent unit's shard stays with the module
        self.counters.bytes_out += (hi - lo) * g.shard.element_size()
        file = self.files.get(id(g))
        if file is not None:
            file.release(lo, hi)

    def flush(self, writer: ThreadPoolExecutor | None) -> list[Future]:
        """End of a step: every file out of the process, then written out and dropped from the page cache."""
        self.release_all()
        if writer is None:
            return []
        return [writer.submit(f.flush, 0, f.tensor.numel()) for f in self.files.values()]

    def release_all(self) -> None:
        for file in self.files.values():
            file.release(0, file.tensor.numel())

    def close(self) -> None:
        """Detach the hooks and close the files (a shard still viewed keeps its mapping alive)."""
        for unit in self.units:
            unit.shard_io = None
        for file in self.files.values():
            file.close()
        self.files.clear()
        self.homes.clear()
