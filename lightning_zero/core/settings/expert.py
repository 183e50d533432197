"""The expert-parallel node of the settings tree, ``ExpertParallelConfig``: how many ranks split each MoE layer's
experts; checked when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism (docs/expert_parallel.md): each MoE layer's experts split over ``size`` ranks of the
    data dimension, tokens sent to their experts' ranks.

    Args:
        size: ranks per expert-parallel group (E / size experts each); 1: off. The data ranks are
            ``expert_data x size`` (Note [expert axes] in core/mesh/dims.py).
    """

    size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"expert_parallel size must be a positive integer, got {self.size!r}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @classmethod
    def coerce(cls, value: int | ExpertParallelConfig | None) -> ExpertParallelConfig | None:
        """``ZeroStrategy(expert_parallel=...)``: an int size, a config, or ``None`` (the MoE layers' own
        ``ep_size``, else off: Note [expert parallel in the strategy] in parallel/expert.py)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(size=value)
        raise TypeError(f"expert_parallel must be an int or an ExpertParallelConfig, got {value!r}")
