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
    need_bytes: int | None = None,
) -> ShardStore:
    """The store of ``config.optimizer_device`` for this rank's optimizer shards.

    Args:
        config: the offload policy.
        rank: the data-parallel rank (names the swap directory).
        units: stage 3's units already sharded (their parameter shards are offloaded with ``param_device``;
            units sharded later come through ``adopt_unit``).
        groups: the flat groups whose shards the store will hold: their swap space is checked first
            (``nvme_path`` with room for :func:`swap_bytes`), before any file is created.
        master_dtype: the masters' dtype (for the swap space).
        need_bytes: the swap space to check instead (the engine's, from the parameter count, when the store
            is opened before the parameters are partitioned).

    Raises:
        ValueError: an ``nvme_path`` that cannot hold the swap files, with the fix.
    """
    store = STORES.get(config.optimizer_device)
    if store is None:
        return DeviceStore()
    if need_bytes is None:
        need_bytes = swap_bytes(config, groups or [], units or [], master_dtype)
    config.check_path(need_bytes)
    return store(config, rank, units)


def swap_bytes(config: OffloadConfig, groups: list[FlatParamGroup], units: list[ShardedUnit],
               master_dtype: torch.dtype) -> int:
    """This rank's bytes in swap files under ``config`` for ``groups`` (and stage 3's ``units``): see
    :func:`swap_bytes_of`."""
    numel = sum(g.shard_numel for g in groups)
    param_bytes = groups[0].flat.element_size() if groups and groups[0].flat is not None else 4
    return swap_bytes_of(config, numel, param_bytes, _itemsize(master_dtype), param_bytes, bool(units))


def swap_bytes_of(config: OffloadConfig, numel: int, param_bytes: int, master_bytes: int, grad_bytes: int,
                  sharded_params: bool) -> int:
    """Bytes in swap files of a rank holding ``numel`` elements of shard (Note [swap files] in ``file_store.py``).

    With ``optimizer_device="nvme"``: the master (unless it is the parameter shard's own file: parameters in
    files too and of the master's dtype), AdamW's two moments and one more element per parameter kept free
    for other optimizers' state; at stage 3 (``sharded_params``) the reduced gradient shard
    (Note [gradients on disk]). With ``param_device="nvme"``: the parameter shard.
    """
    out = 0
    params_in_files = config.param_device is OffloadDevice.nvme
    if config.optimizer_device is OffloadDevice.nvme:
        master = 0 if params_in_files and master_bytes == param_bytes else master_bytes
        out += numel * (master + 3 * master_bytes + (grad_bytes if sharded_params else 0))
    if params_in_files:
        out += numel * param_bytes
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
