"""The settings tree: frozen dataclasses, one node per concern, every value checked where it is built.

Public pieces: the ZeRO node, ``ZeroConfig``, and the flat buffers' dtypes, ``DtypePolicy`` (``zero``); the offload
node, ``OffloadConfig``, with the check of a swap directory, ``nvme_path_problem``, and ``offload_from_args``
(``offload``). Their enums live in ``core/common/choices.py``.
"""

from lightning_zero.core.settings.offload import OffloadConfig, nvme_path_problem, offload_from_args
from lightning_zero.core.settings.zero import DtypePolicy, ZeroConfig

__all__ = ["DtypePolicy", "OffloadConfig", "ZeroConfig", "nvme_path_problem", "offload_from_args"]
