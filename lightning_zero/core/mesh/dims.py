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

Note [expert axes]
    Expert parallelism is carved out of the data dimension: its ranks see different tokens, like data
    ranks, and hold different experts. The data coordinate splits as ``d = e_d * expert + e``, the expert
    axis (``Axis.EXPERT``, ``expert`` ranks) inner, the expert-data axis (``Axis.EXPERT_DATA``, ``data /
    expert`` ranks) outer: an expert-parallel group's ranks, which exchange tokens at every MoE layer, are
    the nearest data ranks (DeepSpeed's layout), and the global rank formula above is unchanged. The
    ranks of an expert-data group hold the same experts: ZeRO reduces and partitions the experts'
    gradients and state over expert-data x sequence (:attr:`ParallelDims.expert_zero_axes`), everything
    else over data x sequence; an expert's gradient, summed over its expert-data group, is divided by
    the whole data x sequence size, as every dense gradient is (each data rank's tokens reach it through
    the all-to-alls).
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
    EXPERT_DATA = "expert_data"  # the data axis's outer part (Note [expert axes])
    EXPERT = "expert"  # the data axis's inner part


ORDER: tuple[Axis, ...] = (Axis.PIPELINE, Axis.DATA, Axis.SEQUENCE, Axis.TENSOR)
# the rank layout with the data axis split into its expert parts (Note [expert axes])
FINE_ORDER: tuple[Axis, ...] = (Axis.PIPELINE, Axis.EXPERT_DATA, Axis.EXPERT, Axis.SEQUENCE, Axis.TENSOR)
# every axis, in the order a group's axes are listed
ALL_AXES: tuple[Axis, ...] = (Axis.PIPELINE, Axis.DATA, Axis.EXPERT_DATA, Axis.EXPERT, Axis.SEQUENCE, Axis.TENSOR)


def _fine(axes: tuple[Axis, ...]) -> tuple[Axis, ...]:
    """``axes`` with the data axis as its two expert parts, in :data:`FINE_ORDER`."""
    wanted = set(axes) | ({Axis.EXPERT_DATA, Axis.EXPERT} if Axis.DATA in axes else set())
    return tuple(a for a in FINE_ORDER if a in wanted)


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension spans; the data dimension is what the others leave of the world.

    Args:
        world_size: all ranks.
        pipeline: pipeline stages.
        tensor: tensor-parallel ranks per layer.
        sequence: sequence-parallel ranks per sample (DeepSpeed-Ulysses).
        expert: expert-parallel ranks per MoE layer, carved out of the data ranks (Note [expert axes]).

    Raises:
        ValueError: a size below 1, a world that is not a multiple of pipeline x sequence x tensor, or data
            ranks that are not a multiple of ``expert`` (the message says which sizes would fit).
    """

    world_size: int
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pipeline", "tensor", "sequence", "expert"):
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
        if self.data % self.expert:
            raise ValueError(
                f"expert_parallel={self.expert} does not divide the {self.data} data-parallel ranks (world "
                f"{self.world_size} / pipeline x sequence x tensor {model}): expert parallelism is carved out of the "
                f"data ranks; choose an expert-parallel size dividing {self.data}, or launch "
                f"{self.expert * model} x n ranks")

    @property
    def data(self) -> int:
        """Data-parallel replicas: the world divided by the model-parallel dimensions."""
        return self.world_size // (self.pipeline * self.sequence * self.tensor)

    @property
    def expert_data(self) -> int:
        """The data ranks holding the same experts (Note [expert axes])."""
        return self.data // self.expert

    def size(self, axis: Axis) -> int:
        return {Axis.PIPELINE: self.pipeline, Axis.DATA: self.data, Axis.SEQUENCE: self.sequence,
                Axis.TENSOR: self.tensor, Axis.EXPERT: self.expert, Axis.EXPERT_DATA: self.expert_data}[axis]

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
    def expert_enabled(self) -> bool:
        return self.expert > 1

    @property
    def zero_axes(self) -> tuple[Axis, ...]:
        """The axes ZeRO partitions and reduces gradients over (module docstring)."""
        return (Axis.DATA, Axis.SEQUENCE)

    @property
    def expert_zero_axes(self) -> tuple[Axis, ...]:
        """The axes ZeRO partitions and reduces the experts' gradients over (Note [expert axes])."""
        return (Axis.EXPERT_DATA, Axis.SEQUENCE)

    def coordinates(self, rank: int) -> dict[Axis, int]:
        """Where global ``rank`` sits on each axis, the data axis and its two expert parts (Note [rank order],
        Note [expert axes])."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out: dict[Axis, int] = {}
        for axis in reversed(FINE_ORDER):
            rank, out[axis] = divmod(rank, self.size(axis))
        out[Axis.DATA] = out[Axis.EXPERT_DATA] * self.expert + out[Axis.EXPERT]
        return out

    def rank_of(self, coordinates: dict[Axis, int]) -> int:
        """The global rank at ``coordinates``: every axis of :data:`ORDER` (the data axis wins over its expert
        parts when both are given), or of :data:`FINE_ORDER`."""
        fine = dict(coordinates)
        if Axis.DATA in fine:
            fine[Axis.EXPERT_DATA], fine[Axis.EXPERT] = divmod(coordinates[Axis.DATA], self.expert)
        rank = 0
        for axis in FINE_ORDER:
            rank = rank * self.size(axis) + fine[axis]
        return rank

    def group_ranks(self, rank: int, axes: tuple[Axis, ...]) -> list[int]:
        """The global ranks that share ``rank``'s coordinates except along ``axes``, in rank order."""
        here = {a: v for a, v in self.coordinates(rank).items() if a is not Axis.DATA}
        fine = _fine(axes)
        ranks = []
        for values in itertools.product(*(range(self.size(a)) for a in fine)):
            ranks.append(self.rank_of({**here, **dict(zip(fine, values))}))
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
        """``pipeline 2 x data 2 x sequence 1 x tensor 2`` (the enabled ones, or ``data 1``; with expert
        parallelism the data axis as ``expert_data 2 x expert 2``)."""
        order = FINE_ORDER if self.expert_enabled else ORDER
        on = [f"{a.value} {self.size(a)}" for a in order if self.enabled(a)]
        return " x ".join(on) or "data 1"
