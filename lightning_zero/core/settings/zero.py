"""The ZeRO node of the settings tree: what is partitioned and how it is communicated (``ZeroConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lightning_zero.core.common.choices import Collective, NonFinitePolicy, ZeroStage


@dataclass(frozen=True)
class ZeroConfig:
    """What is partitioned and how it is communicated.

    Args:
        stage: 0 (data parallel), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters): an int or a
            :class:`ZeroStage` (stored as a ``ZeroStage``).
        reduce_bucket_size: elements per gradient bucket; a bucket is reduced as soon as every
            parameter in it has its gradient (with ``overlap_comm``).
        overlap_comm: launch bucket reductions asynchronously during backward. When false,
            every bucket is reduced after backward, in one go.
        collective: ``"reduce_scatter"`` reduce-scatters gradients and all-gathers parameters;
            ``"all_reduce"`` all-reduces gradient buckets and gathers parameters with one
            broadcast per owning rank. ``"auto"`` takes ``all_reduce`` on gloo (measured
            1.4-2x faster there, see docs/benchmarks.md)
            and ``reduce_scatter`` elsewhere. Memory bounds are the same: the whole gradient is
            never kept beyond one bucket.
        timeout_s: seconds any collective of the strategy may wait before raising.
        hang_timeout_s: seconds without a heartbeat (a silent rank), or without progress of any rank
            while all are alive (ranks in different collectives), after which every rank prints the
            same finding and exits, code 75 or 76 (Note [hang watchdog] in ``core/reliability/heartbeat.py``);
            ``0`` disables the watchdog. Long phases (a checkpoint save, the first step) never trip it.
        nonfinite: ``"off"``, ``"skip"`` or ``"raise"``: what a ``nan`` / ``inf`` reduced gradient does
            in fp32 / bf16 (Note [non-finite policy] in ``core/precision/nonfinite.py``; fp16 keeps its loss scaler).
        prefetch_bucket_size: stage 3: elements gathered ahead of the running unit.
        max_live_parameters: stage 3: elements gathered at once, at most.
        max_reuse_distance: stage 3: a unit stays gathered from its forward into its backward only while the
            elements gathered from its release point to its reuse, its own included, are at most this many
            (DeepSpeed's ``stage3_max_reuse_distance``; 0 keeps none; Note [kept tail] in ``core/stage3/runtime.py``).
        param_persistence_threshold: stage 3: parameters with fewer elements stay gathered.
        activation_checkpointing: recompute each unit's activations in backward instead of keeping
            them (any stage; the units are stage 3's, see ``unit_classes``).
        unit_classes: stage 3: module classes whose instances are gathered as one unit; empty:
            the children of every ``nn.ModuleList`` (Note [units] in ``core/stage3/units.py``).
        elementwise_optimizers: extra optimizer classes to accept for stage >= 1 (their update
            must be element-wise: it may not mix elements of one tensor, e.g. no matrix norms).
    """

    stage: ZeroStage = ZeroStage.GRADIENTS
    reduce_bucket_size: int = 10_000_000
    overlap_comm: bool = True
    collective: Collective = Collective.AUTO
    timeout_s: float = 300.0
    hang_timeout_s: float = 45.0
    nonfinite: NonFinitePolicy = NonFinitePolicy.OFF
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    elementwise_optimizers: tuple[type, ...] = field(default=())
    unit_classes: tuple[type, ...] = field(default=())
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", ZeroStage.of(self.stage))  # users pass ints
        for name in ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"`{name}` must be a positive number of elements, got {getattr(self, name)!r}.")
        reuse = self.max_reuse_distance
        if isinstance(reuse, float) and reuse.is_integer():  # DeepSpeed configs write 1e9
            object.__setattr__(self, "max_reuse_distance", reuse := int(reuse))
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 0:
            raise ValueError(f"`max_reuse_distance` must be a non-negative int number of elements (0 keeps no unit "
                             f"gathered from its forward into its backward), got {reuse!r}.")
        if self.param_persistence_threshold < 0:
            raise ValueError("`param_persistence_threshold` must be >= 0 (0 shards every parameter).")
        object.__setattr__(self, "collective", Collective.of(self.collective, "collective"))  # users pass strings
        for cls in self.unit_classes:
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
                raise ValueError(f"`unit_classes` must hold nn.Module subclasses, got {cls!r}.")
        if not self.timeout_s > 0:
            raise ValueError(f"`timeout_s` must be positive seconds, got {self.timeout_s!r}.")
        if not self.hang_timeout_s >= 0:
            raise ValueError(f"`hang_timeout_s` must be >= 0 seconds (0 disables the watchdog), got "
                             f"{self.hang_timeout_s!r}.")
        object.__setattr__(self, "nonfinite", NonFinitePolicy.of(self.nonfinite, "nonfinite"))  # users pass strings

    @classmethod
    def from_kwargs(cls, stage: int | ZeroStage, kwargs: dict[str, Any]) -> ZeroConfig:
        """Build from keyword arguments, naming the valid keys when one is unknown."""
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"Unknown ZeRO option(s) {unknown}. Valid options: {sorted(valid - {'stage'})}.")
        return cls(stage=stage, **kwargs)
