"""Where partitioned state lives: the offload policy (ZeRO-Offload / ZeRO-Infinity).

Only the policy exists so far; offloading itself is not built, and every entry point refuses a
policy other than "none" with ``NotImplementedError``. The fields are those of DeepSpeed's
``zero_optimization.offload_optimizer`` / ``offload_param`` and of the Hydra ``offload/`` group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OffloadDevice = Literal["none", "cpu", "nvme"]
_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state (fp32 master + moments) and, for stage 3, parameter shards live.

    Args:
        optimizer_device: ``"none"`` (on the accelerator), ``"cpu"`` or ``"nvme"``.
        param_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (stage 3 only; moves the optimizer state too).
        nvme_path: directory on a local NVMe drive, for either device ``"nvme"``.
        pin_memory: page-locked CPU buffers (faster host-device copies).
        buffer_count: I/O buffers per offloaded kind.
        max_in_cpu: parameter elements kept in CPU memory when parameters go to NVMe.
    """

    optimizer_device: OffloadDevice = "none"
    param_device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        for name in ("optimizer_device", "param_device"):
            if getattr(self, name) not in _DEVICES:
                raise ValueError(f"`{name}` must be one of {list(_DEVICES)}, got {getattr(self, name)!r}.")

    @property
    def name(self) -> str:
        """The Hydra ``offload/`` option this amounts to: ``none``, ``optimizer_cpu``, ``param_nvme``, ..."""
        if self.param_device != "none":
            return f"param_{self.param_device}"
        return "none" if self.optimizer_device == "none" else f"optimizer_{self.optimizer_device}"

    @property
    def enabled(self) -> bool:
        return self.name != "none"
