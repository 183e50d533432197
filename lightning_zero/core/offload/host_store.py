"""The host store (``"cpu"``): offloaded optimizer shards in separate host memory, stepped by fused CPU kernels.

:class:`HostStore` is the :class:`~lightning_zero.core.offload.shard_store.ShardStore` of
``optimizer_device="cpu"`` and the base of the file store (``file_store.py``): it owns the master shards
(``new_master``), receives the reduced gradient shards (``receive_grad``) and runs the user's optimizer
step (``step``), then the stepped masters are cast back into the parameter shards (``write_back``).
Masters, gradients and state live in their own host buffers (pinned with an accelerator) and are
stepped all at once with torch's fused CPU kernels. It also owns stage 3's offloaded parameter shards
(``ParamOffload``) and, when either device is ``"nvme"``, the run's private swap directory and its
writer thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.offload.param_offload import ParamOffload
from lightning_zero.core.offload.shard_store import PieceOf, StreamedGrads, SubGroup
from lightning_zero.core.offload.swap_file import remove_stale_run_dirs
from lightning_zero.core.offload.swap_io import IOCounters, SwapIO
from lightning_zero.core.settings.offload import OffloadConfig

if TYPE_CHECKING:
    from lightning_zero.core.comm.grad_home import GradHome
    from lightning_zero.core.common.flat_param import FlatParamGroup
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit

MMAP_THRESHOLD_BYTES = 1 << 20  # Note [freed memory]


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Note [freed memory]
        glibc serves an allocation above its mmap threshold with its own mapping, returned to the OS when
        freed; but the first such free raises the threshold (up to 32 MiB) and the heap's trim threshold
        with it (to twice that), and from then on those buffers come from the heap, which keeps freed
        memory. Offload to disk creates and frees shard-sized temporaries (a unit's shard before it moves
        to its file at setup, a sub-group's lazily created optimizer state, backward's buffers): with the
        dynamic thresholds a GPT-125M rank kept ~200 MiB it no longer used, and a GPT-350M rank's setup
        grew by one shard per unit in some runs (230 MiB to 790 MiB; which runs depended on what the
        process had freed before offload started). Fixing both thresholds (``mallopt(M_MMAP_THRESHOLD)``,
        which also stops the adjustment, and ``M_TRIM_THRESHOLD``) and returning what the heap holds free
        now (``malloc_trim(0)``) keeps the resident set at what is live (docs/offload.md,
        docs/benchmarks.md); ``lightning-zero train`` also sets ``MALLOC_MMAP_THRESHOLD_`` for its ranks,
        which fixes the threshold before the first allocation. Process-wide, set when ``"nvme"`` offload
        starts; glibc only (returns whether it was set).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok = bool(libc.mallopt(-3, threshold)) and bool(libc.mallopt(-1, threshold))  # M_MMAP_ / M_TRIM_THRESHOLD
    trim_heap()
    return ok


def trim_heap() -> None:
    """Return the heap's free pages to the OS (``malloc_trim(0)``; Note [freed memory]): after setup, and after
    each step of ``"nvme"`` offload. glibc only; a no-op elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


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


class HostStore:
    """This rank's optimizer shards in host memory (``"cpu"``; Note [one storage interface] in ``shard_store.py``).

    Args:
        config: the offload policy.
        rank: the data-parallel rank (names its swap directory).
        units: stage 3's units; with ``config.param_device`` set their shards are offloaded too
            (:class:`~lightning_zero.core.offload.param_offload.ParamOffload`, sharing the swap directory).
    """

    device = OffloadDevice.cpu
    runs_step = True
    offloaded = True
    nvme = False  # the optimizer state is in swap files (``FileStore``)

    def __init__(self, config: OffloadConfig, rank: int = 0, units: list[ShardedUnit] | None = None) -> None:
        if config.optimizer_device is not self.device:
            raise ValueError(f"{type(self).__name__} keeps optimizer_device={self.device.value!r} state, "
                             f"not {config.optimizer_device!r}: choose the store with open_shard_store(config).")
        self.config = config
        self.pin = config.pin()
        self.counters = OffloadCounters()
        self.host_grads: dict[int, torch.Tensor] = {}
        self.fence = CopyFence()  # pinned copies in flight (Note [asynchronous host copies] in copy_fence.py)
        self.directory: tempfile.TemporaryDirectory | None = None
        self.io: SwapIO | None = None  # the swap files' reader and writer threads (Note [explicit swap I/O])
        if config.uses_nvme:
            return_freed_memory()  # Note [freed memory]
            remove_stale_run_dirs(str(config.nvme_path))  # killed runs' empty directories (Note [swap files])
            self.directory = tempfile.TemporaryDirectory(prefix=f"lightning_zero-{os.getpid()}-r{rank}-",
                                                         dir=config.nvme_path)
            self.io = SwapIO()
        self.params: ParamOffload | None = None  # offload_param (Note [parameter offload])
        if config.param_device is not OffloadDevice.none:
            directory = self.directory.name if self.directory is not None else None
            self.params = ParamOffload(config.param_device, list(units or []), directory, self.pin, self.io)

    def adopt_unit(self, unit: ShardedUnit) -> None:
        """A stage-3 unit just sharded at setup: its parameter shards move to the offload (``offload_param``)."""
        if self.params is not None:
            self.params.adopt(unit)

    def grad_home(self, sharded_params: bool, dtype: torch.dtype) -> GradHome | None:
        """Host memory keeps the reduced gradient shards with the reducer."""
        return None

    def streamed_grads(self) -> StreamedGrads | None:
        return None

    def io_counters(self) -> IOCounters | None:
        return self.io.counters if self.io is not None else None

    # ------------------------------------------------------------------ storage
    def new_master(self, fi: int, own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of its own for the master of flat group ``fi`` (the caller fills it)."""
        return torch.empty(own.numel(), dtype=dtype, pin_memory=self.pin)

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        return None  # host buffers stay in memory

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The gradient shard the master of ``fi`` steps on: copied (cast) into a host buffer."""
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

    def masters_free(self) -> None:
        """Block until the last write-backs have read the masters (Note [asynchronous host copies])."""
        self.fence.wait_all()

    def use_kernels(self, optimizer: Optimizer) -> dict[int, tuple]:
        return use_fused_kernels(optimizer)

    def write_back(self, own: torch.Tensor, master: torch.Tensor, group: FlatParamGroup, lo: int) -> None:
        """Cast the stepped ``master`` into ``own``: elements ``[lo, lo + own.numel())`` of ``group``'s shard."""
        self.counters.param_bytes_out += own.numel() * own.element_size()
        if self.params is not None and self.params.file_of(group) is not None:  # a swap file: written, not mapped
            self.params.write(group, lo, master if master.dtype == own.dtype else master.to(own.dtype))
            return
        if self.params is not None:  # an offloaded shard may still be read by its last gather's copy
            self.params.before_write(group)
        own.copy_(master, non_blocking=self.pin)
        self.fence.record(("master", id(group), lo), self.pin, master, own)  # the next step overwrites master
        if self.params is not None:
            self.params.written(group, lo, lo + own.numel())

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        return tensor  # the optimizer's own state tensors are host tensors already

    # ------------------------------------------------------------------ step
    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        """Every master in one sub-group: host memory holds them all."""
        return [[(fi, 0, n) for fi, n in enumerate(numels)]]

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None], pieces: PieceOf) -> None:
        """Run ``step_one`` on every sub-group (``pieces``: the optimizer's tensors, unused: host memory holds
        them where they are)."""
        start = time.perf_counter()
        io_before = self._io()  # Note [measured I/O]
        self.fence.wait_all()  # the last step's write-backs have read the masters the CPU overwrites now
        self._run_sub_groups(sub_groups, step_one, pieces)
        if self.io is not None:
            self.io.settle_all()  # every write of the step on disk, the optimizer state out of the page cache
            trim_heap()  # Note [freed memory]
        io_after = self._io() if io_before is not None else None
        if io_before is not None and io_after is not None:
            self.counters.bytes_read += io_after[0] - io_before[0]
            self.counters.bytes_written += io_after[1] - io_before[1]
        self.counters.steps += 1
        self.counters.step_s += time.perf_counter() - start

    def _io(self) -> tuple[int, int] | None:
        """This process's storage traffic so far, where the store measures it (Note [measured I/O])."""
        return None

    def _run_sub_groups(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None],
                        pieces: PieceOf) -> None:
        for sg in sub_groups:
            step_one(sg)

    def release_all(self) -> None:
        """Take every swapped tensor out of this process (after a checkpoint or a load read them)."""
        if self.params is not None:
            self.params.release_all()

    def close(self) -> None:
        """Stop the I/O threads and remove the run's swap files (also done at exit)."""
        if self.io is not None:
            self.io.close()
        if self.params is not None:
            self.params.close()
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None


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
