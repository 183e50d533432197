"""The offload node of the settings tree: where partitioned state lives (ZeRO-Offload / ZeRO-Infinity).

The fields are those of DeepSpeed's ``zero_optimization.offload_optimizer`` / ``offload_param``
and of the Hydra ``offload/`` group. The mechanism is in ``store.py`` and its stores (optimizer shards)
and ``param_offload.py`` (stage-3 parameter shards); see docs/offload.md. Its rules with the ZeRO stage are in
``rules.py`` (Note [one rule, many spellings]).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass

import torch

from lightning_zero.core.common.choices import OffloadDevice
from lightning_zero.core.common.memory import format_bytes

# DeepSpeed's defaults of its I/O knobs (a DeepSpeed JSON without them gets these; Note [swapped step] in
# swap_step.py): offload_optimizer.buffer_count, offload_param.max_in_cpu (not built: only its default is accepted)
DEFAULT_BUFFER_COUNT = 4
DEFAULT_MAX_IN_CPU = 1_000_000_000


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
        buffer_count: with ``optimizer_device="nvme"``, the swap buffers of ``sub_group_size`` elements the step
            goes through (DeepSpeed's ``offload_optimizer.buffer_count``): a sub-group in flight takes one per
            tensor (AdamW: master, gradient, two moments), times the sub-groups the pipeline keeps in flight;
            too few is refused with the count needed. ``None``: as many as the pipeline needs.
        pipeline_read: read the next sub-group's state while this one steps (DeepSpeed's
            ``offload_optimizer.pipeline_read``).
        pipeline_write: write this sub-group's state while the next one steps (``pipeline_write``).
        max_in_cpu: DeepSpeed's cap on parameter elements kept in host memory with ``"nvme"``: not built
            (every offloaded parameter shard is on disk), so only the default 1e9 is accepted.
        sub_group_size: elements of optimizer state stepped (and swapped) at once with ``"nvme"``;
            bounds the part of the state in memory (DeepSpeed's ``zero_optimization.sub_group_size``).
    """

    optimizer_device: OffloadDevice = OffloadDevice.none
    param_device: OffloadDevice = OffloadDevice.none
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int | None = None
    max_in_cpu: int = DEFAULT_MAX_IN_CPU
    sub_group_size: int = 1_000_000
    pipeline_read: bool = True
    pipeline_write: bool = True

    def __post_init__(self) -> None:
        for name in ("optimizer_device", "param_device"):  # users pass strings
            object.__setattr__(self, name, OffloadDevice.of(getattr(self, name), name))
        if self.buffer_count is not None and self.buffer_count < 1:
            raise ValueError(f"offload `buffer_count` must be >= 1 swap buffer (or unset: as many as the pipeline "
                             f"needs), got {self.buffer_count}.")
        if self.max_in_cpu != DEFAULT_MAX_IN_CPU:
            raise ValueError(f"offload `max_in_cpu`={self.max_in_cpu} is not built: with param_device='nvme' every "
                             "offloaded parameter shard is on disk. Fix: leave max_in_cpu at its default "
                             f"{DEFAULT_MAX_IN_CPU:.0e}.")
        if self.sub_group_size < 1:
            raise ValueError(f"offload `sub_group_size` must be >= 1 element, got {self.sub_group_size}.")

    @property
    def name(self) -> str:
        """The Hydra ``offload/`` option this amounts to: ``none``, ``optimizer_cpu``, ``param_nvme``, ..."""
        if self.param_device is not OffloadDevice.none:
            return f"param_{self.param_device}"
        return "none" if self.optimizer_device is OffloadDevice.none else f"optimizer_{self.optimizer_device}"

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def uses_nvme(self) -> bool:
        return OffloadDevice.nvme in (self.optimizer_device, self.param_device)

    def warn_unused(self) -> None:
        """An engine without an optimizer (validate / test / predict outside fit) offloads nothing: say so."""
        if self.enabled:
            warnings.warn(f"offload={self.name} moves the optimizer's shards (and with offload_param the parameter "
                          "shards it steps); without an optimizer (evaluation outside fit) every shard stays in "
                          "memory. Fit to use offload, or leave offload out of evaluation-only runs.", stacklevel=3)

    def check_path(self, need_bytes: int = 0, key: str = "nvme_path") -> None:
        """Refuse an ``nvme_path`` that :func:`nvme_path_problem` finds unusable for ``need_bytes``.

        Args:
            need_bytes: bytes the swap files under it will take (0: not known yet).
            key: how the user sets the path, named in the fix (``offload.nvme_path`` on the command line).

        Raises:
            ValueError: the problem and its fix, in one line.
        """
        if self.uses_nvme:
            problem = nvme_path_problem(str(self.nvme_path), need_bytes, key)
            if problem:
                raise ValueError(problem)

    def pin(self) -> bool:
        """Whether to pin host buffers: asked for, and an accelerator present (else a warning)."""
        if not self.pin_memory:
            return False
        if torch.cuda.is_available():
            return True
        warnings.warn("offload pin_memory=True needs an accelerator (pinning fails without one); using "
                      "ordinary host memory. Set pin_memory=False to silence this.", stacklevel=2)
        return False


def nvme_path_problem(path: str, need_bytes: float = 0, key: str = "nvme_path") -> str | None:
    """Why ``path`` cannot hold swap files of ``need_bytes`` (one line ending in the fix), or ``None``.

    The one check of an ``nvme_path``: the strategy and the engine run it, and so do the command line's
    validation (before any rank starts, with the estimator's figure) and ``lightning-zero advise``.

    Args:
        path: the directory the swap files go under.
        need_bytes: bytes the swap files will take there (0: only existence and writability are checked).
        key: how the user sets the path (``offload.nvme_path``, ``--nvme-path``), named in the fix.
    """
    room = f" with {format_bytes(need_bytes)} free" if need_bytes else ""
    fix = f"Fix: {key}=<a writable directory on a local disk{room}>."
    if not os.path.isdir(path):
        return f"offload nvme_path {path!r} does not exist or is not a directory. {fix}"
    usage = shutil.disk_usage(path)
    if usage.total == 0:
        return (f"offload nvme_path {path!r} is not on a disk (a virtual file system of size 0, like /proc or "
                f"/sys). {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        return f"offload nvme_path {path!r} is not writable by this process. {fix}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".lightning_zero-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"offload nvme_path {path!r} is not writable: a file cannot be created there ({err.strerror}). {fix}"
    if need_bytes > usage.free:
        return (f"offload nvme_path {path!r} has {format_bytes(usage.free)} free but the offloaded state needs "
                f"{format_bytes(need_bytes)}. {fix}")
    return None


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
