"""One stage-3 unit: its flat groups, this rank's shards, and gathering / freeing the whole.

Note [released parameters]
    A released unit's ``nn.Parameter`` objects keep their full shapes (so ``numel()``,
    ``ModelSummary`` and shape-based code see the true model) but their ``.data`` is a NaN
    scalar expanded to that shape: reading one outside the unit's forward / backward gives NaNs
    instead of crashing on freed memory, and writing to it raises. The flat buffer's storage is
    freed separately (``resize_(0)``); tensors the autograd graph saved are views of that
    storage and become valid again when the unit is gathered into it, and the parameters are
    pointed back at their views. Use ``gathered_parameters`` to read or change weights outside
    forward.

Note [version counter]
    Gathering writes into storage the autograd graph saved views of. The write is a re-fill of
    values the graph already saw, so it is done with the version counter preserved, or autograd
    would take it for an in-place modification.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from lightning_zero.core.comm.data_parallel import DataParallelComm, Handle
from lightning_zero.core.common.flat_param import FlatParamGroup
from lightning_zero.core.stage3.gather_pool import GatherPool, lend, take_back
from lightning_zero.core.stage3.units import PERSISTENT


class ShardReader(Protocol):
    """Where an offloaded unit's shards live (``core/offload/param_offload.py``'s ``ParamOffload``:
    host buffers or swap files): gathering asks it for the shard instead of reading ``g.shard``.
    Declared here, below the offload that implements it, so neither module imports the other back."""

    asynchronous: bool
    """Whether :meth:`start_read` returns before the shard is in place (then the runtime reads ahead)."""

    def read(self, g: FlatParamGroup, dest: torch.Tensor) -> None:
        """Copy this rank's shard of ``g`` into ``dest`` (its range of the gather buffer)."""
        ...

    def start_read(self, g: FlatParamGroup, dest: torch.Tensor) -> Callable[[], None]:
        """Start copying this rank's shard of ``g`` into ``dest``; returns the wait for it."""
        ...


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists; the flat storage is freed
    READING = "reading"  # an offloaded shard is being read into the flat storage (Note [read ahead] in runtime.py)
    GATHERING = "gathering"  # an all-gather into the flat storage is in flight
    GATHERED = "gathered"  # the whole parameters are in the flat storage


class ShardedUnit:
    """The flat groups of one unit and their gather / release state.

    Args:
        name: the unit's module name, or ``ROOT`` / ``PERSISTENT``.
        index: position in the engine's unit list (the same on every rank).
        groups: one flat group per optimizer param group present, plus one for frozen params.
    """

    def __init__(self, name: str, index: int, groups: list[FlatParamGroup]) -> None:
        self.name = name
        self.index = index
        self.groups = groups
        self.persistent: bool = name == PERSISTENT  # never released
        self.numel: int = sum(g.padded_numel for g in groups)  # elements while gathered
        self.trainable: list[nn.Parameter] = [s.param for g in groups if g.optimizer_group >= 0 for s in g.slots]
        self.has_frozen: bool = any(g.optimizer_group < 0 for g in groups)
        self.state = UnitState.GATHERED  # bound whole at setup, sharded by shard()
        self._handles: list[Handle] = []
        self._reads: list[Callable[[], None]] = []  # waits of the shard reads in flight (READING)
        self.shard_io: ShardReader | None = None  # offload_param: reads the shards (Note [parameter offload])
        self.pool: GatherPool | None = None  # Note [gather buffer pool]; set by the runtime
        self._lent: dict[int, torch.Tensor] = {}  # Note [one rank]: group index -> the shard whose memory is lent
        self.lend: bool = True  # Note [one rank]; False copies instead (benchmarks/ measures the difference)
        self.gathers: int = 0  # completed gathers since setup (tests count them)
        self.releases: int = 0
        # backward bookkeeping of the current pass
        self.pending_grads: int = 0  # trainable parameters still to report their gradient
        self.inputs_done: bool = False  # the gradient w.r.t. the unit's inputs was computed

    @torch.no_grad()
    def shard(self) -> None:
        """Keep this rank's shard of every group and free the whole buffers."""
        for g in self.groups:
            start, end = g.shard_range()
            # persistent groups stay whole: their shard is a view (no second copy)
            g.shard = g.flat[start:end] if self.persistent else g.flat[start:end].clone()
        if not self.persistent:
            self._free()
        self.state = UnitState.SHARDED if not self.persistent else UnitState.GATHERED

    def _free(self) -> None:
        for i, g in enumerate(self.groups):
            if i in self._lent:  # Note [one rank]
                g.shard = self._lent.pop(i)
                take_back(g.flat, g.shard)
            elif self.pool is not None:
                self.pool.empty(g.flat.untyped_storage())
            else:
                g.flat.untyped_storage().resize_(0)
            for slot in g.slots:  # Note [released parameters]
                slot.param.data = _placeholder(g.flat).expand(slot.shape)

    def _attach(self) -> None:
        """Point the parameters at their views of the (gathered) flat buffers."""
        for g in self.groups:
            for slot, view in zip(g.slots, g.views(g.flat)):
                slot.param.data = view

    def free_storage(self) -> None:
        """Free the flat buffers of a unit that was allocated outside gather / release."""
        self._free()

    def allocate(self) -> None:
        """Give the flat buffers storage again (contents undefined) and attach the parameters."""
        for g in self.groups:
            g.flat.untyped_storage().resize_(g.padded_numel * g.flat.element_size())
        self._attach()

    @property
    def reads_ahead(self) -> bool:
        """Whether its shards are read asynchronously (swap files): the runtime starts the read a unit early."""
        return self.shard_io is not None and self.shard_io.asynchronous

    @torch.no_grad()
    def start_read(self) -> None:
        """Give the flat buffers storage and start reading this rank's shards into their ranges (offloaded
        shards; the all-gather follows in :meth:`start_gather`)."""
        assert self.state is UnitState.SHARDED and self.shard_io is not None, self.state
        for g in self.groups:
            self._fill(g)
            start, end = g.shard_range()
            self._reads.append(self.shard_io.start_read(g, g.flat[start:end]))
        self.state = UnitState.READING

    def _fill(self, g: FlatParamGroup) -> None:
        storage, nbytes = g.flat.untyped_storage(), g.padded_numel * g.flat.element_size()
        if self.pool is not None:
            self.pool.fill(storage, nbytes)
        else:
            storage.resize_(nbytes)

    def _finish_reads(self) -> None:
        reads, self._reads = self._reads, []
        for wait in reads:
            wait()

    @torch.no_grad()
    def start_gather(self, comm: DataParallelComm, may_lend: bool = True) -> None:
        """Start gathering the unit; ``may_lend=False`` copies even at one rank (Note [one rank]). A unit whose
        shards are being read (READING) waits for the reads, then all-gathers."""
        assert self.state in (UnitState.SHARDED, UnitState.READING), self.state
        if self.state is UnitState.READING or self.reads_ahead:
            if self.state is UnitState.SHARDED:
                self.start_read()
            self._finish_reads()
            for g in self.groups:
                start, end = g.shard_range()
                with torch.autograd._unsafe_preserve_version_counter(g.flat):  # Note [version counter]
                    self._handles.append(comm.all_gather_flat(g.flat, start, end, async_op=True))
            self.state = UnitState.GATHERING
            return
        for i, g in enumerate(self.groups):
            c = comm.of(g.experts)  # the experts' groups gather over their expert-data group
            # Note [one rank]: no copy (an offloaded shard is read by shard_io instead)
            if c.world_size == 1 and may_lend and self.lend and self.shard_io is None and lend(g.flat, g.shard):
                self._lent[i], g.shard = g.shard, g.flat[:]
                continue
            self._fill(g)
            start, end = g.shard_range()
            with torch.autograd._unsafe_preserve_version_counter(g.flat):  # Note [version counter]
                source = g.shard  # sent from, and copied into its range while the peers' arrive
                if self.shard_io is not None:  # the shard lives in host buffers (param_offload.py)
                    self.shard_io.read(g, g.flat[start:end])
                    source = None
                # Note [gather from the shard] in core/comm/data_parallel.py
                self._handles.append(c.all_gather_flat(g.flat, start, end, async_op=True, source=source))
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            for h in self._handles:
                h.wait()
            self._handles = []
            self._attach()
            self.state = UnitState.GATHERED
            self.gathers += 1

    def release(self) -> None:
        if self.persistent or self.state is UnitState.SHARDED:
            return
        self._finish_reads()  # a unit read ahead and not gathered: its reads write into the storage freed now
        self.wait()
        self._free()
        self.state = UnitState.SHARDED
        self.releases += 1

    def park_on_cpu(self) -> None:
        """A released unit left released for good (teardown): point its parameters at CPU
        placeholders, so that moving the module to the CPU (Lightning's teardown) allocates
        nothing, where an expanded device placeholder would be copied at full size."""
        if self.state is UnitState.SHARDED:
            for g in self.groups:
                for slot in g.slots:
                    slot.param.data = _placeholder(g.flat.new_empty(0, device="cpu")).expand(slot.shape)

    @torch.no_grad()
    def refresh_persistent(self, comm: DataParallelComm) -> list[Handle]:
        """After an optimizer step: all-gather the persistent groups' updated shards."""
        handles = []
        for g in self.groups:
            start, end = g.shard_range()
            if g.shard.data_ptr() != g.flat[start:end].data_ptr():
                g.flat[start:end].copy_(g.shard)
            handles.append(comm.of(g.experts).all_gather_flat(g.flat, start, end, async_op=True))
        return handles


def is_released(t: torch.Tensor) -> bool:
    """Whether ``t`` is a released parameter's placeholder (Note [released parameters])."""
    return t.numel() > 1 and t.dim() > 0 and all(stride == 0 for stride in t.stride())


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """One NaN (zero for integer dtypes) element of ``like``'s dtype and device, shared."""
    key = (like.dtype, like.device)
    if key not in _PLACEHOLDERS:
        value = float("nan") if like.is_floating_point() else 0
        _PLACEHOLDERS[key] = torch.full((1,), value, dtype=like.dtype, device=like.device)
    return _PLACEHOLDERS[key]
