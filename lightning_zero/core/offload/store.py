"""Where an offloaded optimizer shard lives: separate host memory (``"cpu"``) or swap files (``"nvme"``).

:class:`OptimizerOffload` is the one interface :class:`~lightning_zero.core.zero.optimizer.ShardedOptimizer`
talks to at every stage >= 1: it owns the master shards (``new_master``), receives the reduced
gradient shards (``receive_grad``) and runs the user's optimizer step (``step``), then the stepped
masters are cast back into the parameter shards. ``"cpu"`` keeps masters, gradients and state in
their own host buffers (pinned with an accelerator) and steps them all at once with torch's fused
CPU kernels. ``"nvme"`` keeps masters and per-element state in swap files and steps them in
sub-groups (Note [swap files]).

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

import ctypes
import ctypes.util
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from lightning_zero.core.offload.config import OffloadConfig
from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.offload.param_offload import ParamOffload
from lightning_zero.core.offload.swap_file import SwapFile, remove_stale_run_dirs

if TYPE_CHECKING:
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit
    from lightning_zero.core.zero.flat_param import FlatParamGroup

MMAP_THRESHOLD_BYTES = 1 << 20  # Note [freed memory]


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Note [freed memory]
        glibc serves an allocation above its mmap threshold with its own mapping, returned to the OS when
        freed; but the first such free raises the threshold (up to 32 MiB), and from then on those buffers
        come from the heap, which keeps freed memory. Offload to disk creates and frees shard-sized
        temporaries (a sub-group's lazily created optimizer state before it moves to the files, backward's
        buffers): with the dynamic threshold a GPT-125M rank kept ~200 MiB it no longer used, most of the
        relief. Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops the adjustment) keeps
        the resident set at what is live (docs/offload.md, docs/benchmarks.md). Process-wide, set once
        when ``"nvme"`` offload starts; glibc only (returns whether it was set).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except OSError:
        return False


# optimizer classes whose CPU step has a fused kernel in torch (``fused=True``)
FUSED_CPU_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
)


@dataclass
class OffloadCounters:
    """What moved, cumulative over the run (the tests and the monitor read these)."""

    grad_bytes_in: int = 0  # gradient bytes copied into the host buffers
    param_bytes_out: int = 0  # master bytes cast / copied back into the parameter shards
    bytes_read: int = 0  # bytes this process read from storage during the steps ("nvme"; Note [measured I/O])
    bytes_written: int = 0  # bytes this process sent to storage during the steps ("nvme"; Note [measured I/O])
    steps: int = 0  # offloaded optimizer steps
    step_s: float = 0.0  # seconds inside those steps (I/O waits included)


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


# a sub-group: (flat group, first element, one past the last) ranges, at master-piece boundaries
SubGroup = list[tuple[int, int, int]]


class OptimizerOffload:
    """The host side of this rank's optimizer shards (``"cpu"`` or ``"nvme"``).

    Args:
        config: the offload policy (``optimizer_device`` is ``"cpu"`` or ``"nvme"``).
        rank: the data-parallel rank (names its swap directory).
        units: stage 3's units; with ``config.param_device`` set their shards are offloaded too
            (:class:`~lightning_zero.core.offload.param_offload.ParamOffload`, sharing the swap directory).
    """

    def __init__(self, config: OffloadConfig, rank: int = 0, units: list[ShardedUnit] | None = None) -> None:
        if config.optimizer_device not in ("cpu", "nvme"):
            raise ValueError(f"optimizer_device must be 'cpu' or 'nvme', not {config.optimizer_device!r}.")
        self.config = config
        self.nvme = config.optimizer_device == "nvme"
        self.pin = config.pin()
        self.counters = OffloadCounters()
        self.host_grads: dict[int, torch.Tensor] = {}
        self.fence = CopyFence()  # pinned copies in flight (Note [asynchronous host copies] in copy_fence.py)
        self.files: dict[tuple[int, str], SwapFile] = {}
        self.directory: tempfile.TemporaryDirectory | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._reading: dict[int, list[Future]] = {}  # sub-group index -> its reads in flight
        self._scratch = bytearray(16 << 20) if self.nvme else bytearray()
        if config.uses_nvme:
            return_freed_memory()  # Note [freed memory]
            remove_stale_run_dirs(str(config.nvme_path))  # killed runs' empty directories (Note [swap files])
            self.directory = tempfile.TemporaryDirectory(prefix=f"lightning_zero-{os.getpid()}-r{rank}-",
                                                         dir=config.nvme_path)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-write")
        if self.nvme:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lz-swap-read")
        self.params: ParamOffload | None = None  # offload_param (Note [parameter offload])
        if config.param_device != "none":
            directory = self.directory.name if self.directory is not None else None
            self.params = ParamOffload(config.param_device, list(units or []), directory, self.pin)

    # ------------------------------------------------------------------ storage
    def new_master(self, fi: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Storage of its own for the master of flat group ``fi`` (the caller fills it)."""
        if self.nvme:
            return self._file(fi, "master", numel, dtype).tensor
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        """What to call after writing elements ``[lo, hi)`` of ``fi``'s master outside a step."""
        file = self.files.get((fi, "master"))
        return None if file is None else (lambda lo, hi: file.release(lo, hi) and None)

    def _file(self, fi: int, key: str, numel: int, dtype: torch.dtype) -> SwapFile:
        file = self.files.get((fi, key))
        if file is None:
            assert self.directory is not None
            file = self.files[(fi, key)] = SwapFile(self.directory.name, numel, dtype)
        return file

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The gradient shard the master of ``fi`` steps on: copied (cast) into a host buffer for
        ``"cpu"``; for ``"nvme"`` only when it is not a host tensor of the master's dtype."""
        if self.nvme and grad.device.type == "cpu" and grad.dtype == master.dtype:
            return grad
        host = self.host_grads.get(fi)
        if host is None or host.numel() != master.numel():
            host = self.host_grads[fi] = torch.empty(master.numel(), dtype=master.dtype, pin_memory=self.pin)
        host.copy_(grad, non_blocking=self.pin)
        self.fence.record(("grad", fi), self.pin, grad, host)  # the CPU reads it after grads_ready()
        self.counters.grad_bytes_in += grad.numel() * grad.element_size()
        return host

    def grads_ready(self) -> None:
        """Block until every gradient copy of ``receive_grad`` has landed in host memory (before the
        CPU unscales, measures or steps on them; Note [asynchronous host copies])."""
        for fi in self.host_grads:
            self.fence.wait(("grad", fi))

    def write_back(self, own: torch.Tensor, master: torch.Tensor, group: FlatParamGroup, lo: int) -> None:
        """Cast the stepped ``master`` into ``own``: elements ``[lo, lo + own.numel())`` of ``group``'s shard."""
        if self.params is not None:  # an offloaded shard may still be read by its last gather's copy
            self.params.before_write(group)
        own.copy_(master, non_blocking=self.pin)
        self.fence.record(("master", id(group), lo), self.pin, master, own)  # the next step overwrites master
        self.counters.param_bytes_out += own.numel() * own.element_size()
        if self.params is not None:
            self.params.written(group, lo, lo + own.numel())

    # ------------------------------------------------------------------ step
    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        """Split the masters (``numels`` elements each) into runs of at most ``sub_group_size``
        elements (at least one piece each), at piece boundaries."""
        if not self.nvme:
            return [[(fi, 0, n) for fi, n in enumerate(numels)]]
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

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None]) -> None:
        """Run ``step_one`` on every sub-group; with ``"nvme"``, overlap the next one's reads and the
        previous one's writes with it (Note [swap files])."""
        start = time.perf_counter()
        io_before = process_io() if self.nvme else None  # Note [measured I/O]
        self.fence.wait_all()  # the last step's write-backs have read the masters the CPU overwrites now
        for k, sg in enumerate(sub_groups):
            if self.nvme and k == 0:
                self._prefetch(0, sg)
            if self.nvme and k + 1 < len(sub_groups):
                self._prefetch(k + 1, sub_groups[k + 1])
            for f in self._reading.pop(k, []):
                f.result()
            step_one(sg)
            if self.nvme:
                self._release(sg)
        if self.params is not None:
            self._pending += self.params.flush(self._writer)
        self.wait()
        io_after = process_io() if io_before is not None else None
        if io_before is not None and io_after is not None:
            self.counters.bytes_read += io_after[0] - io_before[0]
            self.counters.bytes_written += io_after[1] - io_before[1]
        self.counters.steps += 1
        self.counters.step_s += time.perf_counter() - start

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        """``"nvme"``: the view of elements ``[lo, lo + tensor.numel())`` of the swap file of state
        ``key`` of flat group ``fi`` (``numel`` elements in all), holding ``tensor``'s values;
        ``tensor`` itself when it already is that view, or for ``"cpu"``."""
        if not self.nvme:
            return tensor
        view = self._file(fi, key, numel, tensor.dtype).tensor[lo : lo + tensor.numel()]
        if view.data_ptr() != tensor.data_ptr():
            view.copy_(tensor.reshape(-1))
        return view.view(tensor.shape)

    def _prefetch(self, k: int, sg: SubGroup) -> None:
        assert self._reader is not None
        for (fi, _key), file in self.files.items():
            for gi, lo, hi in sg:
                if gi == fi:
                    self._reading.setdefault(k, []).append(self._reader.submit(file.prefetch, lo, hi, self._scratch))

    def _release(self, sg: SubGroup) -> None:
        for (fi, _key), file in self.files.items():
            for gi, lo, hi in sg:
                if gi == fi:
                    file.release(lo, hi)
                    assert self._writer is not None
                    self._pending.append(self._writer.submit(file.flush, lo, hi))

    def release_all(self) -> None:
        """Take every swapped tensor out of this process (after a checkpoint or a load read them)."""
        for file in self.files.values():
            file.release(0, file.tensor.numel())
        if self.params is not None:
            self.params.release_all()

    def wait(self) -> None:
        """Wait for the writer thread (raises its error, e.g. a full disk)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Stop the writer and remove the run's swap files (also done at exit)."""
        if self._writer is not None:
            self.wait()
            self._writer.shutdown()
            self._writer = None
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
        for file in self.files.values():
            file.close()
        self.files.clear()
        if self.params is not None:
            self.params.close()
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None


def swap_bytes(config: OffloadConfig, groups: list[FlatParamGroup], units: list[ShardedUnit],
               master_dtype: torch.dtype) -> int:
    """This rank's bytes in swap files under ``config``: with ``optimizer_device="nvme"`` the master and
    state shards of ``groups`` (AdamW's two moments; one more element per parameter is kept free for
    other optimizers' state); with ``param_device="nvme"`` the parameter shards of the non-persistent ``units``."""
    out = 0
    if config.optimizer_device == "nvme":
        out += sum(g.shard_numel for g in groups) * torch.empty((), dtype=master_dtype).element_size() * 4
    if config.param_device == "nvme":
        out += sum(g.shard_numel * g.flat.element_size() for u in units if not u.persistent for g in u.groups)
    return out


def use_fused_kernels(optimizer: Optimizer) -> dict[int, tuple]:
    """Switch the param groups of a torch optimizer with a fused CPU kernel to it; returns what to
    restore (param group index -> previous ``(fused, foreach)``)."""
    if type(optimizer) not in FUSED_CPU_OPTIMIZERS:
        return {}
    previous = {}
    for i, pg in enumerate(optimizer.param_groups):
        if pg.get("differentiable") or pg.get("fused"):
            continue
        previous[i] = (pg.get("fused"), pg.get("foreach"))
        pg["fused"], pg["foreach"] = True, False
    return previous
