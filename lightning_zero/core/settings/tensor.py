"""The tensor-parallel node of the settings tree, ``TensorParallelConfig``: how many ranks split each layer, with
which plan; checked when built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor-slicing model parallelism (docs/tensor_parallel.md).

    Args:
        size: ranks per tensor-parallel group (adjacent ranks: Note [rank order] in core/mesh/dims.py).
        plan: ``None`` (the model's own: a Hugging Face ``_tp_plan`` or the LightningModule's
            ``tensor_parallel_plan``), ``"auto"`` (plain ``nn.Linear`` stacks) or a dict of module-name
            patterns to styles (Note [plan order] in tensor_parallel/plan.py).
        sequence_parallel: split the layer norms' and dropouts' activations along the sequence inside a TP
            group; not built yet, refused.
    """

    size: int = 1
    plan: Mapping[str, Any] | str | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"tensor_parallel size must be a positive integer, got {self.size!r}")
        if self.sequence_parallel:
            raise ValueError("tensor_parallel sequence_parallel=True is not built yet (the layer norms and dropouts "
                             "stay replicated inside a TP group): set sequence_parallel=False")
        if not (self.plan is None or self.plan == "auto" or isinstance(self.plan, Mapping)):
            raise ValueError(f"tensor_parallel plan must be None, 'auto' or a dict of module patterns to styles, "
                             f"got {self.plan!r}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @classmethod
    def coerce(cls, value: int | TensorParallelConfig | None) -> TensorParallelConfig:
        """``ZeroStrategy(tensor_parallel=...)``: an int size, a config, or ``None`` (off)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(size=value)
        raise TypeError(f"tensor_parallel must be an int or a TensorParallelConfig, got {value!r}")
