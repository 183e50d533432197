"""The one interface the sharded optimizer calls for where its shards live: ``ShardStore``, and its device store.

Note [one storage interface]
    :class:`~lightning_zero.core.zero.optimizer.ShardedOptimizer` never asks where its master shards, their
    gradients and the optimizer state live. The engine chooses one store, once, from
    ``OffloadConfig.optimizer_device`` (``open_shard_store`` in ``store.py``):

    * :class:`DeviceStore` (``"none"``): with the parameters, on the training device; the master is the
      parameter shard itself when the dtypes agree, else a cast copy beside it. The user's ``step`` runs
      as it is, and the masters are written back after it (``ZeroEngine.after_step``).
    * ``HostStore`` (``"cpu"``, ``host_store.py``): separate host memory, pinned with an accelerator.
    * ``FileStore`` (``"nvme"``, ``file_store.py``): run-private swap files, stepped in sub-groups with
      overlapped reads and writes (Note [swap files]).

    Every operation of the optimizer calls the store the same way: ``new_master`` (storage for a master),
    ``released`` (after filling one outside a step), ``receive_grad`` / ``grads_ready`` (the reduced
    gradient shard it steps on), ``masters_free`` (before overwriting masters outside a step),
    ``use_kernels`` (the kernel flags its storage wants), ``sub_groups`` / ``step`` / ``write_back``
    (a step run by the store, each stepped sub-group cast back into the parameter shards), ``place``
    (per-element state moved into the storage), ``release_all`` and ``close``. The engine asks it, before
    the optimizer exists, where stage 3's parameter shards go as each unit is sharded (``adopt_unit``) and
    where the reduced gradient shards live (``grad_home``: ``None`` in memory, else swap files), and the step's
    preparation whether the gradients are kept by the store (``streamed_grads``: then the engine's
    unscaling, clipping and norms go through it, Note [gradients on disk] in ``grad_files.py``). The one
    thing a store declares rather than does is ``runs_step``: whether the optimizer's ``step`` runs through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch.optim import Optimizer

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.swap_io import IOCounters

if TYPE_CHECKING:
    from lightning_zero.core.comm.grad_home import GradHome
    from lightning_zero.core.common.flat_param import FlatParamGroup
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit

# a sub-group: (flat group, first element, one past the last) ranges, at master-piece boundaries
SubGroup = list[tuple[int, int, int]]
# piece k of flat group fi's master -> (the optimizer's tensor for it, its state dict)
PieceOf = Callable[[int, int], tuple[torch.Tensor, dict]]


class StreamedGrads(Protocol):
    """Gradients a store keeps out of memory (Note [gradients on disk] in ``grad_files.py``): what the step's
    preparation does to them goes through here."""

    def apply(self, op: Callable[[torch.Tensor], object]) -> None:
        """Run ``op`` in place on every gradient element the optimizer steps on, at the step."""
        ...

    def norms(self, fn: Callable[[torch.Tensor], torch.Tensor], whole: bool, piece: int) -> list[torch.Tensor]:
        """``fn`` of each gradient tensor (each group's shard with ``whole``, else each master piece)."""
        ...

    def materialize(self) -> None:
        """Write the pending operations into the stored gradients."""
        ...


class ShardStore(Protocol):
    """Where this rank's optimizer shards live (Note [one storage interface])."""

    device: OffloadDevice
    """The offload device this store implements."""
    runs_step: bool
    """The optimizer's ``step`` runs through :meth:`step`, which writes each stepped sub-group back."""
    offloaded: bool
    """The shards live apart from the parameters (host memory, swap files): the optimizer steps on the store's
    masters and gradients, never on the reduced gradient buffers themselves, and needs a partitioned optimizer."""

    def new_master(self, fi: int, own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Storage for the master of flat group ``fi`` mirroring ``own`` (the parameter elements); ``own``
        itself when the master is a view of them, else storage the caller fills."""
        ...

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        """What to call after writing elements ``[lo, hi)`` of ``fi``'s master outside a step."""
        ...

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor | None:
        """The gradient shard the master of ``fi`` steps on (``grad``, cast or copied where the master lives);
        ``None`` when the store keeps it (``streamed_grads``) and hands it to the optimizer only in its step."""
        ...

    def grads_ready(self) -> None:
        """Block until every gradient of :meth:`receive_grad` can be read by the CPU."""
        ...

    def masters_free(self) -> None:
        """Block until the last write-backs have read the masters (before they are overwritten)."""
        ...

    def use_kernels(self, optimizer: Optimizer) -> dict[int, tuple]:
        """Switch the optimizer to the kernels this storage steps best with; what to restore (param group
        index -> previous ``(fused, foreach)``)."""
        ...

    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        """The masters (``numels`` elements each) in the runs a step walks, at ``piece`` boundaries."""
        ...

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None], pieces: PieceOf) -> None:
        """Run ``step_one`` on every sub-group (only where :attr:`runs_step`); ``pieces`` gives the optimizer's
        tensors of a sub-group, for a store that points them at its buffers while it steps."""
        ...

    def write_back(self, own: torch.Tensor, master: torch.Tensor, group: FlatParamGroup, lo: int) -> None:
        """Cast the stepped ``master`` into ``own``: elements ``[lo, lo + own.numel())`` of ``group``'s shard."""
        ...

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        """Per-element state ``key`` of elements ``[lo, lo + tensor.numel())`` of ``fi``'s master (``numel`` in
        all), moved into the storage: the tensor to keep in the optimizer's state."""
        ...

    def release_all(self) -> None:
        """Take every stored tensor out of the process again (after reads or writes outside a step)."""
        ...

    def close(self) -> None:
        """Free the storage (buffers, threads, files)."""
        ...

    def adopt_unit(self, unit: ShardedUnit) -> None:
        """A stage-3 unit was just sharded at setup: move its parameter shards where this store keeps them."""
        ...

    def grad_home(self, sharded_params: bool, dtype: torch.dtype) -> GradHome | None:
        """Where the reduced gradient shards (``dtype``) live; ``None``: in memory, with the reducer.
        ``sharded_params``: stage 3 (the parameters are not in memory either)."""
        ...

    def streamed_grads(self) -> StreamedGrads | None:
        """The gradients this store keeps out of memory, or ``None``."""
        ...

    def io_counters(self) -> IOCounters | None:
        """What its swap-file threads moved and waited (Note [I/O overlap] in ``swap_io.py``), or ``None``."""
        ...


class DeviceStore:
    """Shards with the parameters, on the training device (``"none"``; Note [one storage interface])."""

    device = OffloadDevice.none
    runs_step = False
    offloaded = False

    def new_master(self, fi: int, own: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype == own.dtype:
            return own
        return torch.empty(own.numel(), dtype=dtype, device=own.device)

    def released(self, fi: int) -> Callable[[int, int], None] | None:
        return None

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        return grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def grads_ready(self) -> None:
        """Nothing to wait for: the gradients are where the masters are, on the same stream."""

    def masters_free(self) -> None:
        """Nothing to wait for: write-backs are ordinary copies on the device's stream."""

    def use_kernels(self, optimizer: Optimizer) -> dict[int, tuple]:
        return {}  # the user's choice of kernel

    def sub_groups(self, numels: list[int], piece: int) -> list[SubGroup]:
        return [[(fi, 0, n) for fi, n in enumerate(numels)]]

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None], pieces: PieceOf) -> None:
        for sg in sub_groups:
            step_one(sg)

    def write_back(self, own: torch.Tensor, master: torch.Tensor, group: FlatParamGroup, lo: int) -> None:
        own.copy_(master)

    def place(self, fi: int, key: str, lo: int, tensor: torch.Tensor, numel: int) -> torch.Tensor:
        return tensor

    def release_all(self) -> None:
        """Nothing is swapped."""

    def close(self) -> None:
        """Nothing of its own: the masters go with the optimizer's state."""

    def adopt_unit(self, unit: ShardedUnit) -> None:
        """Parameter shards stay with the units."""

    def grad_home(self, sharded_params: bool, dtype: torch.dtype) -> GradHome | None:
        return None

    def streamed_grads(self) -> StreamedGrads | None:
        return None

    def io_counters(self) -> IOCounters | None:
        return None
