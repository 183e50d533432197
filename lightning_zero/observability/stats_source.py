"""What :class:`~lightning_zero.ZeroStatsMonitor` reads from the strategy: a narrow, typed view.

Note [the monitor reads a view, not the engine]
    The monitor needs a handful of numbers per step (gradient norm, loss scale, model-state bytes)
    and the clock and byte counter of the data-parallel collectives. It reads them through
    :class:`StepStatsSource`, which ``ZeroStrategy`` satisfies, never through ``strategy.engine``:
    the engine's layout can change without the observer noticing, and any other strategy
    simply has no source (the monitor then logs loss, lr, throughput, time and peak memory).
"""

from __future__ import annotations

from functools import cache
from typing import Protocol, cast, runtime_checkable

import lightning.pytorch as pl

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.memory import ModelStateBytes
from lightning_zero.core.offload.swap_io import IOCounters


@runtime_checkable
class StepStatsSource(Protocol):
    """The strategy-side numbers of a step (Note [the monitor reads a view, not the engine])."""

    @property
    def engine_comm(self) -> DataParallelComm | None:
        """The running engine's data-parallel collectives (blocked time, bytes sent); ``None`` without one."""
        ...

    @property
    def pipelined(self) -> bool:
        """Whether a step runs a pipeline schedule (Note [no split for pipelines] in callbacks.py)."""
        ...

    @property
    def last_grad_norm(self) -> float | None: ...

    @property
    def last_step_skipped(self) -> bool: ...

    @property
    def loss_scale(self) -> float | None: ...

    @property
    def skipped_steps(self) -> int: ...

    def measure_grad_norm(self) -> float | None:
        """The global norm of the gradients held now (collective on every rank); ``None`` without an engine."""
        ...

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's model-state bytes; only called while :attr:`engine_comm` is not ``None``."""
        ...

    @property
    def swap_io(self) -> IOCounters | None:
        """Disk offload's swap-file I/O so far (bytes, the I/O threads' busy time, the time waited), or ``None``."""
        ...


_MEMBERS = tuple(name for name in vars(StepStatsSource) if not name.startswith("_"))


@cache
def _provides(kind: type) -> bool:
    """Whether instances of ``kind`` are :class:`StepStatsSource`: checked on the class, once per class (an
    ``isinstance`` against the Protocol would run every property on each of the monitor's hook calls)."""
    return all(hasattr(kind, name) for name in _MEMBERS)


def stats_source(trainer: pl.Trainer) -> StepStatsSource | None:
    """The trainer's strategy when it provides the step's numbers, else ``None``."""
    strategy = trainer.strategy
    return cast(StepStatsSource, strategy) if _provides(type(strategy)) else None
