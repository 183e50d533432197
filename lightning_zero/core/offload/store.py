"""Choosing, once, where this rank's optimizer shards live: ``open_shard_store``, and the swap space it will take.

The engine calls :func:`open_shard_store` at construction and hands the store to the sharded optimizer,
which from then on calls it without asking where the shards are (Note [one storage interface] in
``shard_store.py``): ``"none"`` a :class:`~lightning_zero.core.offload.shard_store.DeviceStore`, ``"cpu"`` a
:class:`~lightning_zero.core.offload.host_store.HostStore`, ``"nvme"`` a
:class:`~lightning_zero.core.offload.file_store.FileStore` (Note [swap files] in ``file_store.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.offload.file_store import FileStore
from lightning_zero.core.offload.host_store import HostStore
from lightning_zero.core.offload.shard_store import DeviceStore, ShardStore
from lightning_zero.core.settings.offload import OffloadConfig

if TYPE_CHECKING:
    from lightning_zero.core.common.flat_param import FlatParamGroup
    from lightning_zero.core.stage3.sharded_unit import ShardedUnit

STORES: dict[OffloadDevice, type[HostStore]] = {OffloadDevice.cpu: HostStore, OffloadDevice.nvme: FileStore}


def open_shard_store(
    config: OffloadConfig, rank: int = 0, units: list[ShardedUnit] | None = None,
    groups: list[FlatParamGroup] | None = None, master_dtype: torch.dtype = torch.float32,
) -> ShardStore:
    """The store of ``config.optimizer_device`` for this rank's optimizer shards.

    Args:
        config: the offload policy.
        rank: the data-parallel rank (names the swap directory).
        units: stage 3's units (their parameter shards are offloaded with ``param_device``).
        groups: the flat groups whose shards the store will hold: their swap space is checked first
            (``nvme_path`` with room for :func:`swap_bytes`), before any file is created.
        master_dtype: the masters' dtype (for the swap space).

    Raises:
        ValueError: an ``nvme_path`` that cannot hold the swap files, with the fix.
    """
    store = STORES.get(config.optimizer_device)
    if store is None:
        return DeviceStore()
    config.check_path(swap_bytes(config, groups or [], units or [], master_dtype))
    return store(config, rank, units)


def swap_bytes(config: OffloadConfig, groups: list[FlatParamGroup], units: list[ShardedUnit],
               master_dtype: torch.dtype) -> int:
    """This rank's bytes in swap files under ``config``: with ``optimizer_device="nvme"`` the master and
    state shards of ``groups`` (AdamW's two moments; one more element per parameter is kept free for
    other optimizers' state); with ``param_device="nvme"`` the parameter shards of the non-persistent ``units``."""
    out = 0
    if config.optimizer_device is OffloadDevice.nvme:
        out += sum(g.shard_numel for g in groups) * torch.empty((), dtype=master_dtype).element_size() * 4
    if config.param_device is OffloadDevice.nvme:
        out += sum(g.shard_numel * g.flat.element_size() for u in units if not u.persistent for g in u.groups)
    return out
