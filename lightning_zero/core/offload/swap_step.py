"""The optimizer's step through a fixed set of swap buffers (``"nvme"`` offload): ``SwappedStep``.

Note [swapped step]
    With its state in swap files, the optimizer steps sub-group by sub-group (``sub_group_size`` elements,
    at master-piece boundaries). For each sub-group every tensor it needs is read into a swap buffer of its
    own: the master, the gradient (``grad_files.py``; cast to the master dtype and given the engine's pending
    operations there: in mixed precision its buffer has a 16-bit read area beside it) and each per-element
    optimizer state (AdamW: ``exp_avg``, ``exp_avg_sq``). The optimizer
    then steps those buffers (its pieces' ``.data``, ``.grad`` and state entries point into them for the
    step; between steps they are the files' mappings again), and the master and state buffers are written
    back. A buffer is one tensor of a sub-group: AdamW needs four per sub-group, as DeepSpeed counts them.

    DeepSpeed's knobs mean what they say there (``offload_optimizer``):

    * ``buffer_count``: the buffers there are. A sub-group in flight takes one per tensor;
    * ``pipeline_read``: the next sub-group's reads run on the reader thread while this one steps (a
      second set of buffers);
    * ``pipeline_write``: this sub-group's writes run on the writer thread while the next one steps (a third
      set); the writes on their way to disk are bounded (Note [bounded write-back] in ``swap_io.py``) and the
      optimizer state leaves the page cache once on disk (the parameters' file stays: the next forward reads it);
    * without either, each sub-group is read, stepped and written in turn.

    Too few buffers for the pipeline asked is refused with the count it needs. Memory: buffers x the
    largest sub-group's elements x the element size, allocated once and kept for the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.offload.swap_io import SwapIO


@dataclass(frozen=True)
class Range:
    """Elements ``[lo, lo + numel)`` of ``file``, at ``offset`` in its kind's buffer."""

    file: SwapFile
    lo: int
    numel: int
    offset: int


@dataclass
class SubGroupPlan:
    """What one sub-group swaps: its ranges by kind (``"master"``, ``"grad"``, state keys), which kinds are
    written back after the step, and how the optimizer's tensors are pointed at the buffers and back."""

    ranges: dict[str, list[Range]] = field(default_factory=dict)
    written: tuple[str, ...] = ()
    cached: frozenset[str] = frozenset()  # written kinds left in the page cache (read again before the next step)
    cast: dict[str, torch.dtype] = field(default_factory=dict)  # kind read in its file's dtype, stepped in this
    bind: Callable[[dict[str, torch.Tensor]], None] = lambda buffers: None
    unbind: Callable[[], None] = lambda: None

    def buffers_needed(self) -> int:
        """One per tensor (a gradient read in 16 bits and stepped in 32 keeps its read area with its buffer)."""
        return len(self.ranges)


class BufferSet:
    """One buffer per kind of tensor, each as large as the largest sub-group (allocated on first use)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        key = (kind, dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(self.numel, dtype=dtype)
        return self.buffers[key]

    def pointers(self) -> set[int]:
        return {b.untyped_storage().data_ptr() for b in self.buffers.values()}


class SwappedStep:
    """Runs a step's sub-groups through buffer sets (Note [swapped step]).

    Args:
        io: the reader and writer threads.
        buffer_count: buffers there are (``None``: as many as the pipeline needs).
        pipeline_read: read the next sub-group while this one steps.
        pipeline_write: write this sub-group while the next one steps.
    """

    def __init__(self, io: SwapIO | None, buffer_count: int | None, pipeline_read: bool, pipeline_write: bool,
                 ) -> None:
        self.io = io
        self.buffer_count = buffer_count
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write
        self.sets: list[BufferSet] = []
        self.bound: set[int] = set()  # storages of the buffers the optimizer steps now

    @property
    def set_count(self) -> int:
        return 1 + self.pipeline_read + self.pipeline_write

    def check(self, per_sub_group: int, what: str = "") -> None:
        """Refuse a ``buffer_count`` too small for ``per_sub_group`` buffers in each of the pipeline's sets."""
        need = per_sub_group * self.set_count
        if self.buffer_count is not None and self.buffer_count < need:
            stages = ["stepping", *["reading the next"] * self.pipeline_read,
                      *["writing the last"] * self.pipeline_write]
            raise ValueError(
                f"offload buffer_count={self.buffer_count} is too few swap buffers: each sub-group in flight takes "
                f"{per_sub_group} ({what or 'the master, its gradient and each per-element optimizer state'}), and "
                f"{self.set_count} sub-group(s) are in flight ({', '.join(stages)}). Fix: buffer_count>={need}, or "
                "pipeline_read / pipeline_write off, or leave buffer_count unset (as many as needed)."
            )

    def run(self, plans: list[SubGroupPlan], step_one: Callable[[int], None]) -> None:
        """Step every sub-group: ``step_one(k)`` runs the optimizer on sub-group ``k`` once its plan's bind has
        pointed its tensors at the buffers."""
        if not plans:
            return
        assert self.io is not None, "a step needs the store's I/O threads"
        io = self.io
        numel = max(sum(r.numel for r in rs) for p in plans for rs in p.ranges.values())
        self.check(max(p.buffers_needed() for p in plans))
        if not self.sets or self.sets[0].numel < numel:
            self.sets = [BufferSet(numel) for _ in range(self.set_count)]
        free: deque[BufferSet] = deque(self.sets)
        writing: deque[tuple[BufferSet, list[Future]]] = deque()
        reading: dict[int, tuple[BufferSet, list[Future]]] = {}

        def take() -> BufferSet:
            if not free:  # the oldest write's buffers come back once it is on disk
                done, futures = writing.popleft()
                io.wait(futures)
                free.append(done)
            return free.popleft()

        def start_reads(k: int) -> None:
            buffers = take()
            futures = [io.read(r.file, r.lo, self._view(buffers, plans[k], kind, r, raw=True))
                       for kind, ranges in plans[k].ranges.items() for r in ranges]
            reading[k] = (buffers, futures)

        try:
            for k, plan in enumerate(plans):
                if k not in reading:
                    start_reads(k)
                buffers, futures = reading.pop(k)
                io.wait(futures)
                if self.pipeline_read and k + 1 < len(plans):
                    start_reads(k + 1)
                views = {}
                for kind in plan.ranges:
                    whole = buffers.get(kind, plan.cast.get(kind, plan.ranges[kind][0].file.dtype))
                    if kind in plan.cast:  # read in the file's dtype: cast into the stepped buffer
                        used = sum(r.numel for r in plan.ranges[kind])
                        whole[:used].copy_(buffers.get(f"{kind}:raw", plan.ranges[kind][0].file.dtype)[:used])
                    views[kind] = whole
                self.bound = buffers.pointers()
                plan.bind(views)
                try:
                    step_one(k)
                finally:
                    plan.unbind()
                    self.bound = set()
                futures = [io.write(r.file, r.lo, self._view(buffers, plan, kind, r), drop=kind not in plan.cached)
                           for kind in plan.written for r in plan.ranges.get(kind, [])]
                if self.pipeline_write:
                    writing.append((buffers, futures))
                else:
                    io.wait(futures)
                    free.append(buffers)
        finally:
            for k in list(reading):
                io.wait(reading.pop(k)[1])
            while writing:
                io.wait(writing.popleft()[1])

    @staticmethod
    def _view(buffers: BufferSet, plan: SubGroupPlan, kind: str, r: Range, raw: bool = False) -> torch.Tensor:
        """The buffer elements of range ``r`` of ``kind`` (``raw``: where a cast kind is read, in the file's dtype)."""
        if raw and kind in plan.cast:
            return buffers.get(f"{kind}:raw", r.file.dtype)[r.offset : r.offset + r.numel]
        return buffers.get(kind, plan.cast.get(kind, r.file.dtype))[r.offset : r.offset + r.numel]

    def is_bound(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in the buffers the optimizer steps now (the swap-out writes it)."""
        return t.untyped_storage().data_ptr() in self.bound
