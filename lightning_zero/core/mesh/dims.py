"""The sizes of the parallel dimensions, checked once, and where each rank sits in them.

Note [rank order]
    The world is laid out as pipeline x data x sequence x tensor, the tensor dimension innermost:
    global rank ``r = ((p * data + d) * sequence + s) * tensor + t``. So a tensor-parallel group's
    ranks are adjacent (they exchange activations every layer: the heaviest, most frequent traffic
    stays on a node), a sequence group comes next (an all-to-all around each attention), then data
    parallelism (one reduction per step), and pipeline stages outermost (point-to-point activations,
    the lightest traffic, cross nodes first). This is Megatron's and DeepSpeed's order, and it
    keeps the previous two-dimensional layout (``stage = r // (world / stages)``) unchanged.

ZeRO partitions its shards over data x sequence (:attr:`ParallelDims.zero_axes`): the ranks of a
sequence group hold different tokens of the same samples, so their gradients are summed like data
parallel ones, as DeepSpeed-Ulysses folds the sequence group into ZeRO's. Lightning's sampler shards
the data over the data dimension only: every rank of a sequence or tensor group sees the same batch.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class Axis(enum.Enum):
    """A dimension of the device mesh, outermost first (Note [rank order])."""

    PIPELINE = "pipeline"
    DATA = "data"
    SEQUENCE = "sequence"
    TENSOR = "tensor"


ORDER: tuple[Axis, ...] = (Axis.PIPELINE, Axis.DATA, Axis.SEQUENCE, Axis.TENSOR)


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension spans; the data dimension is what the others leave of the world.

    Args:
        world_size: all ranks.
        pipeline: pipeline stages.
        tensor: tensor-parallel ranks per layer.
        sequence: sequence-parallel ranks per sample (DeepSpeed-Ulysses).

    Raises:
        ValueError: a size below 1, or a world that is not a multiple of pipeline x sequence x tensor
            (the message says which sizes would fit).
    """

    world_size: int
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pipeline", "tensor", "sequence"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        model = self.pipeline * self.sequence * self.tensor
        if self.world_size % model:
            fits = [n for n in range(model, 4 * model + 1, model)]
            raise ValueError(
                f"the world size {self.world_size} is not a multiple of pipeline x sequence x tensor = "
                f"{self.pipeline} x {self.sequence} x {self.tensor} = {model}: launch {fits[:3]}... ranks "
                f"(trainer.devices x trainer.num_nodes), or choose sizes whose product divides {self.world_size}")

    @property
    def data(self) -> int:
        """Data-parallel replicas: the world divided by the model-parallel dimensions."""
        return self.world_size // (self.pipeline * self.sequence * self.tensor)

    def size(self, axis: Axis) -> int:
        return {Axis.PIPELINE: self.pipeline, Axis.DATA: self.data, Axis.SEQUENCE: self.sequence,
                Axis.TENSOR: self.tensor}[axis]

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes in :data:`ORDER`."""
        return tuple(self.size(a) for a in ORDER)

    def enabled(self, axis: Axis) -> bool:
        """Whether ``axis`` spans more than one rank."""
        return self.size(axis) > 1

    @property
    def pipeline_enabled(self) -> bool:
        return self.pipeline > 1

    @property
    def tensor_enabled(self) -> bool:
        return self.tensor > 1

    @property
    def sequence_enabled(self) -> bool:
        return self.sequence > 1

    @property
    def data_enabled(self) -> bool:
        return self.data > 1

    @property
    def zero_axes(self) -> tuple[Axis, ...]:
        """The axes ZeRO partitions and reduces gradients over (module docstring)."""
        return (Axis.DATA, Axis.SEQUENCE)

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """Where global ``rank`` sits on each axis (Note [rank order])."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out: dict[Axis, int] = {}
        for axis in reversed(ORDER):
            rank, out[axis] = divmod(rank, self.size(axis))
        return out

    def rank_of(self, coordinates: dict[Axis, int]) -> int:
        """The global rank at ``coordinates`` (every axis given)."""
        rank = 0
        for axis in ORDER:
            rank = rank * self.size(axis) + coordinates[axis]
        return rank

    def group_ranks(self, rank: int, axes: tuple[Axis, ...]) -> list[int]:
        """The global ranks that share ``rank``'s coordinates except along ``axes``, in rank order."""
        here = self.coordinates(rank)
        ranks = []
        for values in itertools.product(*(range(self.size(a)) for a in axes)):
            ranks.append(self.rank_of({**here, **dict(zip(axes, values))}))
        return sorted(ranks)

    def all_groups(self, axes: tuple[Axis, ...]) -> list[list[int]]:
        """Every group along ``axes``, each in rank order, the groups ordered by their first rank: the
        same list on every rank (``dist.new_group`` must be called in the same order everywhere)."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            group = self.group_ranks(rank, axes)
            seen.setdefault(group[0], group)
        return [seen[k] for k in sorted(seen)]

    def describe(self) -> str:
        """``pipeline 2 x data 2 x sequence 1 x tensor 2`` (the enabled ones, or ``data 1``)."""
        on = [f"{a.value} {self.size(a)}" for a in ORDER if self.enabled(a)]
        return " x ".join(on) or "data 1"
