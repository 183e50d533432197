"""Where optimizer and parameter shards live: on the device, in host memory or in run-private swap files.

Public pieces: the one storage interface of the optimizer's
shards (Note [one storage interface]): ``ShardStore`` and ``DeviceStore`` (``shard_store``), ``HostStore``
(``host_store``), ``FileStore`` (``file_store``), chosen by ``open_shard_store`` (``store``); stage 3's parameter
offload, ``ParamOffload`` (``param_offload``), the swap file, ``SwapFile`` (``swap_file``) and the CUDA copy fence,
``CopyFence`` (``copy_fence``).
"""

from lightning_zero.core.offload.copy_fence import CopyFence
from lightning_zero.core.offload.file_store import FileStore
from lightning_zero.core.offload.host_store import HostStore
from lightning_zero.core.offload.param_offload import ParamOffload
from lightning_zero.core.offload.shard_store import DeviceStore, ShardStore
from lightning_zero.core.offload.store import open_shard_store
from lightning_zero.core.offload.swap_file import SwapFile

__all__ = ["CopyFence", "DeviceStore", "FileStore", "HostStore", "ParamOffload", "ShardStore", "SwapFile",
           "open_shard_store"]
