"""Where partitioned state lives: the offload policy (ZeRO-Offload / ZeRO-Infinity) and its checks.

The fields are those of DeepSpeed's ``zero_optimization.offload_optimizer`` / ``offload_param``
and of the Hydra ``offload/`` group. The mechanism is in ``offload_store.py`` (optimizer shards)
and ``param_offload.py`` (stage-3 parameter shards); see docs/offload.md.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

OffloadDevice = Literal["none", "cpu", "nvme"]
_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state (fp32 master + moments) and, for stage 3, parameter shards live.

    Args:
        optimizer_device: ``"none"`` (with the parameters), ``"cpu"`` (separate host memory,
            stages 1-3) or ``"nvme"`` (swap files under ``nvme_path``, stages 1-3).
        param_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (stage 3 only; needs the optimizer
            offloaded too).
        nvme_path: an existing, writable directory on a local disk, for either device ``"nvme"``;
            the run's swap files live in a private directory below it, removed at exit.
        pin_memory: page-locked host buffers (faster, asynchronous host-device copies). Only with an
            accelerator: without one it warns and uses ordinary memory.
        buffer_count: I/O buffers per offloaded kind (DeepSpeed's knob; sub-groups in flight here).
        max_in_cpu: parameter elements kept in CPU memory when parameters go to NVMe.
        sub_group_size: elements of optimizer state stepped (and swapped) at once with ``"nvme"``;
            bounds the part of the state in memory (DeepSpeed's ``zero_optimization.sub_group_size``).
    """

    optimizer_device: OffloadDevice = "none"
    param_device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    max_in_cpu: int = 1_000_000_000
    sub_group_size: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("optimizer_device", "param_device"):
            if getattr(self, name) not in _DEVICES:
                raise ValueError(f"`{name}` must be one of {list(_DEVICES)}, got {getattr(self, name)!r}.")
        if self.buffer_count < 1:
            raise ValueError(f"offload `buffer_count` must be >= 1, got {self.buffer_count}.")
        if self.sub_group_size < 1:
            raise ValueError(f"offload `sub_group_size` must be >= 1 element, got {self.sub_group_size}.")

    @property
    def name(self) -> str:
        """The Hydra ``offload/`` option this amounts to: ``none``, ``optimizer_cpu``, ``param_nvme``, ..."""
        if self.param_device != "none":
            return f"param_{self.param_device}"
        return "none" if self.optimizer_device == "none" else f"optimizer_{self.optimizer_device}"

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer_device, self.param_device)

    def check(self, stage: int) -> None:
        """Refuse, with the fix, a policy that ``stage`` cannot run (no file system access).

        Raises:
            ValueError: an invalid combination.
        """
        if not self.enabled:
            return
        if self.param_device != "none" and stage != 3:
            raise ValueError(f"offload_param={self.param_device!r} needs ZeRO stage 3 (partitioned parameters), "
                             f"got stage {stage}. Fix: stage=3, or offload_param='none'.")
        if self.param_device != "none" and self.optimizer_device == "none":
            raise ValueError(f"offload_param={self.param_device!r} moves the optimizer state too. Fix: also set "
                             f"offload_optimizer={self.param_device!r}.")
        if stage == 0:
            raise ValueError(f"offload_optimizer={self.optimizer_device!r} offloads this rank's optimizer shard and "
                             "needs ZeRO stage 1, 2 or 3, got stage 0. Fix: stage>=1, or offload_optimizer='none'.")
        if self.uses_nvme and not self.nvme_path:
            raise ValueError(f"offload={self.name} needs `nvme_path`: an existing, writable directory on a local disk.")

    def warn_unused(self) -> None:
        """An engine without an optimizer (validate / test / predict outside fit) offloads nothing: say so."""
        if self.enabled:
            warnings.warn(f"offload={self.name} moves the optimizer's shards (and with offload_param the parameter "
                          "shards it steps); without an optimizer (evaluation outside fit) every shard stays in "
                          "memory. Fit to use offload, or leave offload out of evaluation-only runs.", stacklevel=3)

    def check_path(self, need_bytes: int = 0) -> None:
        """Refuse an ``nvme_path`` that does not exist, is not a writable directory or lacks ``need_bytes``."""
        if not self.uses_nvme:
            return
        path = str(self.nvme_path)
        if not os.path.isdir(path):
            raise ValueError(f"offload nvme_path {path!r} does not exist or is not a directory. Fix: create it "
                             "(a directory on a local disk) or pass another `nvme_path`.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"offload nvme_path {path!r} is not writable by this process. Fix: pass a directory "
                             "you can write to as `nvme_path`.")
        free = shutil.disk_usage(path).free
        if need_bytes > free:
            raise ValueError(f"offload nvme_path {path!r} has {free / 2**30:.2f} GiB free but this rank's offloaded "
                             f"state needs {need_bytes / 2**30:.2f} GiB. Fix: free space, or point `nvme_path` at a "
                             "larger disk.")

    def pin(self) -> bool:
        """Whether to pin host buffers: asked for, and an accelerator present (else a warning)."""
        if not self.pin_memory:
            return False
        if torch.cuda.is_available():
            return True
        warnings.warn("offload pin_memory=True needs an accelerator (pinning fails without one); using "
                      "ordinary host memory. Set pin_memory=False to silence this.", stacklevel=2)
        return False


def offload_from_args(
    offload: OffloadConfig | None, offload_optimizer: str | None, offload_param: str | None, nvme_path: str | None,
) -> OffloadConfig:
    """One :class:`OffloadConfig` from ``ZeroStrategy``'s shortcut arguments or a full config (not both)."""
    shortcuts = {"offload_optimizer": offload_optimizer, "offload_param": offload_param, "nvme_path": nvme_path}
    given = {k: v for k, v in shortcuts.items() if v is not None}
    if offload is not None:
        if given:
            raise ValueError(f"Pass either `offload=OffloadConfig(...)` or {sorted(given)}, not both.")
        return offload
    param = offload_param or "none"
    optimizer = offload_optimizer or (param if param != "none" else "none")
    return OffloadConfig(optimizer_device=optimizer, param_device=param, nvme_path=nvme_path)  # type: ignore[arg-type]
