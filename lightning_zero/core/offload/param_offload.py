"""Stage-3 parameter offload: where each rank's parameter shards live (``"cpu"`` buffers or ``"nvme"`` files).

Note [parameter offload]
    At stage 3 a released unit exists on this rank only as ``FlatParamGroup.shard``, one 1-D shard
    per flat group. With ``offload_param`` those shards move into storage of their own as each unit is
    sharded at setup (:meth:`ParamOffload.adopt`, called by ``apply_stage3`` right after the unit's
    ``shard()``, so setup never holds more than one unit's shard in memory): ``"cpu"``, a host buffer per
    shard (pinned when ``pin_memory`` and an accelerator); ``"nvme"``, a run-private swap file per shard
    (``SwapFile``, Note [swap files] in ``file_store.py``), written with ``pwritev``; the group's ``shard`` is
    then the file's mapping, which only uses outside a step touch (Note [explicit swap I/O]).
    The persistent unit (parameters below ``param_persistence_threshold``) stays whole with the
    module, as it is gathered every step anyway.

    In: ``ShardedUnit`` hands the copy of the shard into the unit's gather buffer to :meth:`start_read`
    (the hook ``ShardedUnit.shard_io``). With ``"nvme"`` it is a ``preadv`` straight into the buffer's range
    on the reader thread (``swap_io.py``), started by stage 3's prefetch one unit before the unit's all-gather
    is issued, so the read overlaps the compute of the unit before (Note [read ahead] in
    ``core/stage3/runtime.py``); ``"cpu"`` copies at once.

    Out: the optimizer's store casts each stepped master range into the shard (:meth:`write`): ``"cpu"`` a
    copy into the host buffer, ``"nvme"`` a ``pwritev`` into the file (from the store's swap buffer). With fp32
    masters and ``"nvme"`` the master *is* the shard's file (``FileStore.new_master``): stepping it writes the
    parameters, nothing is cast. Reads and writes outside a step (a checkpoint, ``gathered_parameters``,
    loading) go through the mapping; :meth:`release_all` takes those pages out of the process again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.offload.swap_io import SwapIO

if TYPE_CHECKING:
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit


@dataclass
class ParamOffloadCounters:
    """Parameter-shard traffic, cumulative over the run (tests and benchmarks read these)."""

    bytes_in: int = 0  # shard bytes brought into gather buffers
    bytes_out: int = 0  # stepped bytes written into the offloaded shards
    shards: int = 0  # offloaded shards (flat groups of non-persistent units)
    shard_bytes: int = 0  # their total size


def _done() -> None:
    """The wait of a read that is already complete."""


class ParamOffload:
    """The offloaded parameter shards of this rank's stage-3 units (Note [parameter offload]).

    Args:
        device: :attr:`OffloadDevice.cpu` or :attr:`OffloadDevice.nvme` (or its string, ``"cpu"`` / ``"nvme"``).
        units: units already sharded to offload now (more come through :meth:`adopt`); the persistent one stays.
        directory: the run's private swap directory (``"nvme"``).
        pin: pin the host buffers (``"cpu"``; only with an accelerator).
        io: the store's reader and writer threads (``"nvme"``; default: threads of its own).
    """

    def __init__(self, device: OffloadDevice | str, units: list[ShardedUnit], directory: str | None,
                 pin: bool = False, io: SwapIO | None = None) -> None:
        if device not in (OffloadDevice.cpu, OffloadDevice.nvme):
            raise ValueError(f"param offload device must be 'cpu' or 'nvme', not {device!r}.")
        self.device = OffloadDevice(device)
        self.nvme = self.device is OffloadDevice.nvme
        self.pin = pin and not self.nvme
        self.directory = directory
        self._io = io
        self._own_io = io is None  # threads of its own, started on first use
        self.counters = ParamOffloadCounters()
        self.fence = CopyFence()  # pinned shard -> device copies in flight (Note [asynchronous host copies])
        self.units: list[ShardedUnit] = []
        self.files: dict[int, SwapFile] = {}  # id(flat group) -> its swap file
        self.offloaded: set[int] = set()
        self.homes: dict[int, torch.Tensor] = {}  # id(flat group) -> the storage its shard lives in
        for unit in units:
            self.adopt(unit)

    @property
    def io(self) -> SwapIO:
        """The reader and writer threads of the swap files."""
        if self._io is None:
            self._io = SwapIO()
        return self._io

    @property
    def asynchronous(self) -> bool:
        """Whether :meth:`start_read` returns before the shard is in place (the runtime then reads ahead)."""
        return self.nvme

    @torch.no_grad()
    def adopt(self, unit: ShardedUnit) -> None:
        """Move the sharded ``unit``'s shards into this offload's storage (nothing for the persistent unit)."""
        if unit.persistent:
            return
        for g in unit.groups:
            g.shard = self.homes[id(g)] = self._home(g)
            self.offloaded.add(id(g))
            self.counters.shards += 1
            self.counters.shard_bytes += g.shard.numel() * g.shard.element_size()
        unit.shard_io = self
        # stage 3 at world size 1 may lend a shard's memory to the gather buffer instead of copying it
        # (``ShardedUnit.lend``, issue 21's speed items): never an offloaded shard, whose storage is the store's
        unit.lend = False
        self.units.append(unit)

    def _home(self, g: FlatParamGroup) -> torch.Tensor:
        assert g.shard is not None, "param offload needs the unit sharded first"
        if not self.nvme:
            return torch.empty(g.shard.numel(), dtype=g.shard.dtype, pin_memory=self.pin).copy_(g.shard)
        assert self.directory is not None
        file = self.files[id(g)] = SwapFile(self.directory, g.shard.numel(), g.shard.dtype)
        self.io.write_now(file, 0, g.shard.contiguous())
        return file.tensor

    def file_of(self, g: FlatParamGroup) -> SwapFile | None:
        """The swap file ``g``'s shard lives in (``"nvme"``), else ``None``."""
        return self.files.get(id(g))

    # ------------------------------------------------------------------ the hooks
    def read(self, g: FlatParamGroup, dest: torch.Tensor) -> None:
        """Copy this rank's shard of ``g`` into ``dest`` (its range of the gather buffer), now."""
        self.start_read(g, dest)()

    def start_read(self, g: FlatParamGroup, dest: torch.Tensor) -> Callable[[], None]:
        """Start copying this rank's shard of ``g`` into ``dest``; returns the wait for it (``"nvme"``: a read on
        the reader thread; ``"cpu"``: done at once)."""
        assert g.shard is not None
        self.counters.bytes_in += g.shard.numel() * g.shard.element_size()
        file = self.files.get(id(g))
        if file is None:
            dest.copy_(g.shard, non_blocking=self.pin)
            self.fence.record(id(g), self.pin, g.shard, dest)  # before_write(g) waits for it
            return _done
        io = self.io
        future = io.read(file, 0, dest)
        return lambda: io.wait([future])

    def before_write(self, g: FlatParamGroup) -> None:
        """Before the CPU overwrites ``g``'s shard: the device has finished reading it (Note
        [asynchronous host copies] in copy_fence.py)."""
        self.fence.wait(id(g))

    def write(self, g: FlatParamGroup, lo: int, values: torch.Tensor) -> None:
        """Elements ``[lo, lo + values.numel())`` of ``g``'s shard := ``values`` (already in the shard's dtype):
        a copy into the host buffer, or a write into the swap file on the calling thread."""
        self.before_write(g)
        file = self.files.get(id(g))
        if file is None:
            assert g.shard is not None
            g.shard[lo : lo + values.numel()].copy_(values)
        else:
            self.io.write_now(file, lo, values.contiguous())
        self.written(g, lo, lo + values.numel())

    def written(self, g: FlatParamGroup, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of ``g``'s shard were just written by the optimizer's write-back."""
        if id(g) in self.offloaded and g.shard is not None:
            self.counters.bytes_out += (hi - lo) * g.shard.element_size()

    def release_all(self) -> None:
        """Take pages read or written through the mappings (outside a step) out of the process."""
        for file in self.files.values():
            file.release(0, file.numel)

    def close(self) -> None:
        """Detach the hooks and close the files (a shard still viewed keeps its mapping alive)."""
        for unit in self.units:
            unit.shard_io = None
        if self._own_io and self._io is not None:
            self._io.close()
            self._io = None
        for file in self.files.values():
            file.close()
        self.files.clear()
        self.homes.clear()
