"""Stage 3's reduced gradient shards in swap files (``"nvme"`` offload): ``GradFiles``.

Note [gradients on disk]
    At stage 3 with the optimizer in swap files, this rank's reduced gradient shards (4Ψ/N bytes in fp32,
    as large as its parameter shards) would be the one piece of model state left in memory. Instead the
    reducer writes each reduced message part into a swap file per flat group (``GradHome`` in
    ``core/zero/exchange.py``): the first reduction of a bucket since ``zero_grad`` writes its range, later
    ones (gradient accumulation) read it back, add in rank order and write again, so the values are those
    the in-memory shard would hold, bit for bit. The writes go out on the training thread (``pwritev`` into
    the page cache, the write-out to disk started at once: Note [explicit swap I/O]).

    The step then needs them three ways, none of which brings the whole shard into memory:

    * the optimizer reads each sub-group's gradient into a swap buffer with the rest of its state
      (``swap_step.py``), casts it to the master dtype there, and applies the operations the engine asked for
      on the gradients in the meantime (:meth:`apply`: unscaling by the loss scale, clipping by norm or value),
      in the order asked, on each element as they would have run on the whole tensor;
    * norms (:meth:`norms`): with gradients in the master dtype (fp32, bf16-true) the engine measures each
      group's whole shard, read into a buffer one group at a time (the largest group's shard: at stage 3 a
      unit's, half a unit at 2 ranks); in mixed precision it measures the master pieces, streamed through a
      buffer with the pending operations applied. Either way each value is computed over the same tensor as
      without offload;
    * anything else that reads a shard as a tensor (``GradShards.read``: a mapping of the file) after
      :meth:`materialize` has written the pending operations into the files (only where the files hold the
      master dtype: else the operations act on the cast copies, never on the shard, as without offload).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_zero.core.comm.grad_home import sum_in_rank_order
from lightning_zero.core.offload.swap_file import SwapFile
from lightning_zero.core.offload.swap_io import SwapIO

GradOp = Callable[[torch.Tensor], Any]


class GradFiles:
    """This rank's reduced gradient shards, one swap file per flat group (Note [gradients on disk]).

    Args:
        directory: the run's private swap directory.
        io: the store's reader and writer threads.
        dtype: the dtype the gradients are kept in (``grad_accum_dtype``).
    """

    def __init__(self, directory: str, io: SwapIO, dtype: torch.dtype) -> None:
        self.directory = directory
        self.io = io
        self.dtype = dtype
        self.master_dtype = dtype  # the dtype the optimizer steps them in: the masters' (set when handed over)
        self.files: dict[int, SwapFile] = {}
        self.ops: list[GradOp] = []  # operations asked for since the gradients were handed over, in order
        self._scratch: torch.Tensor | None = None  # gradient accumulation: the range read back

    # ------------------------------------------------------------------ GradHome (the reducer writes)
    def tensor(self, group_index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        file = self.files.get(group_index)
        if file is None:
            file = self.files[group_index] = SwapFile(self.directory, numel, dtype)
        return file.tensor

    def accumulate(self, group_index: int, lo: int, terms: list[torch.Tensor], first: bool) -> None:
        file = self.files[group_index]
        if first:  # terms are scratch: the first accumulates in place (sum_in_rank_order's order)
            acc = terms[0]
            for t in terms[1:]:
                acc.add_(t)
            self.io.write_now(file, lo, acc.contiguous())
            return
        n = terms[0].numel()
        if self._scratch is None or self._scratch.numel() < n or self._scratch.dtype != file.dtype:
            self._scratch = torch.empty(n, dtype=file.dtype)
        target = self._scratch[:n]
        self.io.read_now(file, lo, target)
        sum_in_rank_order(terms, target, first=False)
        self.io.write_now(file, lo, target)

    def zero(self, group_index: int, lo: int, hi: int) -> None:
        file = self.files[group_index]
        step = 1 << 20
        zeros = torch.zeros(min(step, hi - lo), dtype=file.dtype)
        for a in range(lo, hi, step):
            self.io.write_now(file, a, zeros[: min(step, hi - a)])

    # ------------------------------------------------------------------ what the engine asks
    def handed_over(self) -> None:
        """New gradients reach the optimizer: no operation is pending on them."""
        self.ops = []

    def apply(self, op: GradOp) -> None:
        """Run ``op`` (in place, element-wise) on every gradient element the optimizer steps on, in the master
        dtype: at the step, on each sub-group's buffer (after the operations asked before it)."""
        self.ops.append(op)

    def run_ops(self, t: torch.Tensor) -> None:
        """The pending operations on ``t`` (a buffer of gradients in the master dtype), in order."""
        for op in self.ops:
            op(t)

    def norms(self, fn: Callable[[torch.Tensor], torch.Tensor], whole: bool, piece: int) -> list[torch.Tensor]:
        """``fn`` of each gradient tensor the engine measures, in its order: with ``whole`` each group's shard
        (through the mapping, one group at a time), else each master piece of ``piece`` elements, read into a
        master-dtype buffer with the pending operations applied."""
        out: list[torch.Tensor] = []
        if whole:
            self.materialize()
            largest = max((f.numel for f in self.files.values()), default=0)
            buffer = torch.empty(largest, dtype=self.dtype)  # one group's shard at a time, read in one call
        for gi in sorted(self.files):
            file = self.files[gi]
            if whole:
                if file.numel:
                    self.io.read_now(file, 0, buffer[: file.numel])
                    out.append(fn(buffer[: file.numel]).clone())
                continue
            buffer = torch.empty(min(piece, file.numel), dtype=self.master_dtype)
            raw = buffer if file.dtype == self.master_dtype else torch.empty(buffer.numel(), dtype=file.dtype)
            for lo in range(0, file.numel, piece):
                n = min(piece, file.numel - lo)
                view = buffer[:n]
                self.io.read_now(file, lo, raw[:n])
                if raw is not buffer:
                    view.copy_(raw[:n])
                self.run_ops(view)
                out.append(fn(view))
        return out

    def materialize(self) -> None:
        """Write the pending operations into the files, so that their mappings hold what the optimizer steps
        on (files in the master dtype only)."""
        if not self.ops:
            return
        step = 1 << 20
        for file in self.files.values():
            if file.dtype != self.master_dtype:
                raise RuntimeError("gradients kept in another dtype than the masters cannot take the optimizer's "
                                   "pending operations in place; read them through the step.")
            buffer = torch.empty(min(step, file.numel), dtype=file.dtype)
            for lo in range(0, file.numel, step):
                view = buffer[: min(step, file.numel - lo)]
                self.io.read_now(file, lo, view)
                self.run_ops(view)
                self.io.write_now(file, lo, view)
        self.ops = []

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()
