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
    (per-element state moved into the storage), ``release_all`` and ``close``. The one thing a store
    declares rather than does is ``runs_step``: whether the optimizer's ``step`` runs through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch.optim import Optimizer

from lightning_zero.core.common.choices import OffloadDevice

if TYPE_CHECKING:
    from lightning_zero.core.common.flat_param import FlatParamGroup

# a sub-group: (flat group, first element, one past the last) ranges, at master-piece boundaries
SubGroup = list[tuple[int, int, int]]


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

    def receive_grad(self, fi: int, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The gradient shard the master of ``fi`` steps on (``grad``, cast or copied where the master lives)."""
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

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None]) -> None:
        """Run ``step_one`` on every sub-group (only where :attr:`runs_step`)."""
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

    def step(self, sub_groups: list[SubGroup], step_one: Callable[[SubGroup], None]) -> None:
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
