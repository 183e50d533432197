"""The file store (``"nvme"``): an offloaded optimizer shard in run-private swap files, stepped through buffers.

:class:`FileStore` is the :class:`~lightning_zero.core.offload.shard_store.ShardStore` of
``optimizer_device="nvme"``: a :class:`~lightning_zero.core.offload.host_store.HostStore` whose masters
and per-element state live in swap files, read into fixed swap buffers sub-group by sub-group for the
step and written back from them (Note [swapped step] in ``swap_step.py``); at stage 3 the reduced gradient
shards live in swap files too (Note [gradients on disk] in ``grad_files.py``).

Note [swap files]
    Each (flat group, state key) has one file under a directory private to the run
    (``<nvme_path>/lightning_zero-<pid>-r<rank>-<random>``); so do stage 3's parameter shards and gradient
    shards. A file is unlinked as soon as it is opened, so it disappears when the process exits, however it
    exits, and no later run can ever read it as state. A run killed by a signal leaves its empty directory;
    the next run to start there removes those of this user whose process is gone (``remove_stale_run_dirs``).
    The training step moves the files' bytes with explicit reads and writes (Note [explicit swap I/O] in
    ``swap_file.py``); between steps the optimizer's tensors are the files' ``MAP_SHARED`` mappings, so
    checkpoints and ``state_dict`` see ordinary CPU tensors. State the optimizer creates lazily (at its first
    step, or loaded from a checkpoint) is written into the files right after. With fp32 masters (a master in
    the parameters' dtype) and the parameter shards in files too, the master *is* the parameter shard's file:
    stepping it writes the parameters, with no second copy on disk and nothing to cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.grad_files import GradFiles
from lightning_zero.core.offload.host_store import HostStore, trim_heap
from lightning_zero.core.offload.shard_store import PieceOf, StreamedGrads, SubGroup
from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.offload.swap_step import Range, SubGroupPlan, SwappedStep
from lightning_zero.core.settings.offload import OffloadConfig

if TYPE_CHECKING:
    from lightning_zero.core.comm.grad_home import GradHome
    from lightning_zero.core.common.flat_param import FlatParamGroup
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit


def process_io() -> tuple[int, int] | None:
    """Note [measured I/O]
        ``bytes_read`` / ``bytes_written`` are what the kernel accounted to this process (all its
        threads: the reader and writer threads too) as read from and sent to the storage layer
        (``read_bytes`` / ``write_bytes`` of ``/proc/self/io``) while the offloaded steps ran: pages
        served from the page cache count nothing, pages written count when dirtied. They are the disk
        traffic of the swap files, not the sizes of the ranges handed to the I/O threads (a file system
        in memory, such as tmpfs, reads and writes nothing). Where ``/proc/self/io`` cannot be read this
        returns ``None`` and the two counters stay 0.
    """
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def state_tensors(optimizer: Optimizer) -> int | None:
    """Per-element state tensors a torch optimizer keeps (``None``: not known before it steps)."""
    groups = optimizer.param_groups
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 + any(g.get("amsgrad") for g in groups)
    if isinstance(optimizer, torch.optim.SGD):
        return int(any(g.get("momentum", 0) for g in groups))
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    return None


class FileStore(HostStore):
    """This rank's optimizer shards in swap files (``"nvme"``; Note [swap files]).

    Args: as :class:`HostStore`'s.
    """

    device = OffloadDevice.nvme
    nvme = True

    def __init__(self, config: OffloadConfig, rank: int = 0, units: list[ShardedUnit] | None = None) -> None:
        super().__init__(config, rank, units)
        assert self.io is not None and self.directory is not None
        self.files: dict[tuple[int, str], SwapFile] = {}  # (flat group, state key) -> file; "master" included
        self.grads: GradFiles | None = None  # stage 3: the reduced gradient shards (Note [gradients on disk])
        self.swapped = SwappedStep(self.io, config.buffer_count, config.pipeline_read, config.pipeline_write)
        self._aliases: set[int] = set()  # mappings that are a master and a parameter shard at once
        self._piece = 1

    # ------------------------------------------------------------------ storage
    def new_master(self, fi: int, own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The swap file of the master of flat group ``fi`` (the caller fills it); the parameter shard's own
        file when it is one and has the master's dtype (Note [swap files])."""
        shard = self._param_file(own)
        if shard is not None and dtype == own.dtype:
            self.files[(fi, "master")] = shard
            self._aliases.add(shard.tensor.untyped_storage().data_ptr())
            return own
        return self._file(fi, "master", own.numel(), dtype).tensor

    def _param_file(self, own: torch.Tensor) -> SwapFile | None:
        if self.params is None or not own.numel():
            return None
        return next((f for f in self.params.files.values()
                     if f.numel == own.numel() and f.tensor.data_ptr() == own.data_ptr()), None)

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        file = self.files.get((fi, "master"))
        return None if file is None else (lambda lo, hi: file.release(lo, hi) and None)

    def _file(self, fi: int, key: str, numel: int, dtype: torch.dtype) -> SwapFile:
        file = self.files.get((fi, key))
        if file is None:
            assert self.directory is not None
            file = self.files[(fi, key)] = SwapFile(self.directory.name, numel, dtype)
        return file

    def grad_home(self, sharded_params: bool, dtype: torch.dtype) -> GradHome | None:
        """Stage 3: the reduced gradient shards in swap files (Note [gradients on disk]); else in memory."""
        if not sharded_params:
            return None
        if self.grads is None:
            assert self.directory is not None and self.io is not None
            self.grads = GradFiles(self.directory.name, self.io, dtype)  # the masters' dtype: at receive_grad
        return self.grads

    def streamed_grads(self) -> StreamedGrads | None:
        return self.grads

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor | None:
        """``None`` with the gradients in files (the step reads them); else the gradient itself when it is a
        host tensor of the master's dtype, else a host buffer's copy."""
        if self.grads is not None:
            self.grads.master_dtype = master.dtype
            self.grads.handed_over()
            return None
        if grad.device.type == "cpu" and grad.dtype == master.dtype:
            return grad
        return super().receive_grad(fi, grad, master)

    def use_kernels(self, optimizer: Optimizer) -> dict[int, tuple]:
        """The fused kernels (as the host store); and a ``buffer_count`` too small for this optimizer's
        sub-groups is refused now, before any step (Note [swapped step])."""
        count = state_tensors(optimizer)
        if count is not None:
            self.swapped.check(2 + count, f"the master, its gradient and {count} optimizer state tensor(s) of "
                                          f"{type(optimizer).__name__}")
        return super().use_kernels(optimizer)

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        """The view of elements ``[lo, lo + tensor.numel())`` of the swap file of state ``key`` of flat group
        ``fi`` (``numel`` elements in all), holding ``tensor``'s values (written now); ``tensor`` itself when
        it is that view, or a swap buffer of the running step (written back after it)."""
        file = self._file(fi, key, numel, tensor.dtype)
        view = file.tensor[lo : lo + tensor.numel()]
        if self.swapped.is_bound(tensor) or view.data_ptr() == tensor.data_ptr():
            return tensor
        assert self.io is not None
        self.io.write(file, lo, tensor.reshape(-1).contiguous())  # on disk, out of the page cache by the step's end
        return view.view(tensor.shape)

    def write_back(self, own: torch.Tensor, master: torch.Tensor, group: FlatParamGroup, lo: int) -> None:
        """Cast the stepped ``master`` into ``own``; nothing when ``own`` is the master's own file (written back
        with the master)."""
        if own.untyped_storage().data_ptr() in self._aliases:
            self.counters.param_bytes_out += own.numel() * own.element_size()
            if self.params is not None:
                self.params.written(group, lo, lo + own.numel())
            return
        super().write_back(own, master, group, lo)

    # ------------------------------------------------------------------ step
    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        """Split the masters (``numels`` elements each) into runs of at most ``sub_group_size``
        elements (at least one piece each), at piece boundaries."""
        self._piece = piece
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

    def _run_sub_groups(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None],
                        pieces: PieceOf) -> None:
        plans = [self._plan(sg, pieces) for sg in sub_groups]
        self.swapped.run(plans, lambda k: step_one(sub_groups[k]))

    def _plan(self, sg: SubGroup, pieces: PieceOf) -> SubGroupPlan:
        """What sub-group ``sg`` swaps (Note [swapped step]) and how its pieces are pointed at the buffers."""
        plan = SubGroupPlan()
        entries: list[tuple[int, int, int, int]] = []  # (flat group, lo, hi, offset in the buffers)
        offset = 0
        for fi, lo, hi in sg:
            kinds = [k for (f, k) in self.files if f == fi]
            for key in ["master", *sorted(k for k in kinds if k != "master")]:
                plan.ranges.setdefault(key, []).append(Range(self.files[(fi, key)], lo, hi - lo, offset))
            if self.grads is not None:
                file = self.grads.files[fi]
                plan.ranges.setdefault("grad", []).append(Range(file, lo, hi - lo, offset))
                if file.dtype != self.grads.master_dtype:
                    plan.cast["grad"] = self.grads.master_dtype
            entries.append((fi, lo, hi, offset))
            offset += hi - lo
        plan.written = tuple(k for k in plan.ranges if k != "grad")
        if any(self.files[(fi, "master")].tensor.untyped_storage().data_ptr() in self._aliases for fi, *_ in sg):
            plan.cached = frozenset({"master"})  # the parameters' own file: the next forward reads it
        states = tuple(k for k in plan.written if k != "master")
        n = self._piece

        def each_piece() -> list[tuple[int, int, int, torch.Tensor, dict]]:
            out = []
            for fi, lo, hi, off in entries:
                for k in range(lo // n, math.ceil(hi / n)):
                    piece, state = pieces(fi, k)
                    out.append((fi, k * n, k * n - lo + off, piece, state))
            return out

        def bind(views: dict[str, torch.Tensor]) -> None:
            if self.grads is not None and "grad" in views:
                if "grad" in plan.cast:  # cast from the files' dtype into the buffer (as receive_grad's copy)
                    self.counters.grad_bytes_in += offset * plan.ranges["grad"][0].file.itemsize
                self.grads.run_ops(views["grad"][:offset])
            for _fi, _start, at, piece, state in each_piece():
                m = piece.numel()
                piece.data = views["master"][at : at + m]
                if "grad" in views:
                    piece.grad = views["grad"][at : at + m]
                for key in states:
                    value = state.get(key)
                    if isinstance(value, torch.Tensor) and value.shape == piece.shape:
                        state[key] = views[key][at : at + m].view(piece.shape)

        def unbind() -> None:
            for fi, start, _at, piece, state in each_piece():
                m = piece.numel()
                piece.data = self.files[(fi, "master")].tensor[start : start + m]
                if self.grads is not None:
                    piece.grad = None
                for key in states:
                    value = state.get(key)
                    if isinstance(value, torch.Tensor) and self.swapped.is_bound(value):
                        state[key] = self.files[(fi, key)].tensor[start : start + m].view(piece.shape)

        plan.bind, plan.unbind = bind, unbind
        return plan

    def release_all(self) -> None:
        """Every file's pages out of the process, and what was written through the mappings on disk and out of
        the page cache (after a fill, a load or a checkpoint: Note [explicit swap I/O])."""
        if self.io is not None:
            self.io.settle_all()
        for file in self.files.values():
            file.release(0, file.numel)
            file.settle(0, file.numel)
        if self.grads is not None:
            for file in self.grads.files.values():
                file.release(0, file.numel)
        super().release_all()
        trim_heap()  # Note [freed memory]: what setup or a load freed leaves the process too

    def close(self) -> None:
        """Stop the threads, close the swap files and remove the run's directory (also done at exit)."""
        if self.io is not None:
            self.io.drain()
        if self.grads is not None:
            self.grads.close()
        aliases = {id(f) for f in self.params.files.values()} if self.params is not None else set()
        for file in self.files.values():
            if id(file) not in aliases:  # a parameter shard's file: closed with the parameter offload
                file.close()
        self.files.clear()
        self.swapped.sets = []
        super().close()
