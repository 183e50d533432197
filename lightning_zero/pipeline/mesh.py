"""The pipeline's view of the process mesh: this rank's stage, its replica, and the pipeline's groups.

Note [rank layout]
    Global rank ``r`` holds pipeline stage ``r // dp`` and data-parallel index ``r % dp`` (``dp``
    = world size / stages): the ranks of one stage are contiguous, so with several ranks per node
    a stage's data-parallel collectives (ZeRO's reduce-scatter and gathers, the heavy traffic)
    stay on a node, while the pipeline's point-to-point activations cross nodes. With virtual
    stages, rank ``r`` runs model chunks ``r // dp + k * stages`` for ``k < virtual_stages``. This is
    the pipeline axis outermost of Note [rank order] in ``core/mesh/dims.py``; :class:`PipelineMesh`
    is that arithmetic, :func:`pipeline_groups` takes the stage's data-parallel group and the
    replica's pipeline group from the strategy's :class:`~lightning_zero.core.mesh.ProcessMesh`.
    With tensor parallelism ``dp`` counts the ranks of a stage (data x tensor) and ``r % dp`` is the
    index inside it, so ``global_rank(stage, r % dp)`` is the same TP rank of another stage: the
    mesh's pipeline group, over which activations and tied gradients go.

The groups of tied parameters depend on the model (which stages share a parameter), so they are
created here, from the mesh's sizes: every rank creates every one (``dist.new_group`` is collective
over the world, in the same order everywhere) and keeps the ones it belongs to.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.core.mesh import Axis, ProcessMesh


@dataclass(frozen=True)
class PipelineMesh:
    """This rank's place in the 2D layout (Note [rank layout]).

    Args:
        stages: pipeline stages.
        dp_size: data-parallel replicas.
        rank: this rank's global rank.
    """

    stages: int
    dp_size: int
    rank: int

    @classmethod
    def of(cls, mesh: ProcessMesh) -> PipelineMesh:
        """The pipeline's view of ``mesh``: its stages, the ranks per stage, this rank."""
        return cls(mesh.dims.pipeline, mesh.dims.world_size // mesh.dims.pipeline, mesh.rank)

    @property
    def stage(self) -> int:
        return self.rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_size

    def global_rank(self, stage: int, dp_rank: int) -> int:
        return stage * self.dp_size + dp_rank

    def pipeline_ranks(self, dp_rank: int | None = None) -> list[int]:
        """The global ranks of one replica's pipeline, stage order (default: this rank's)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return [self.global_rank(s, d) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int | None = None) -> list[int]:
        s = self.stage if stage is None else stage
        return [self.global_rank(s, d) for d in range(self.dp_size)]

    def chunk_indices(self, virtual_stages: int) -> list[int]:
        """The model chunks this rank runs (looped placement, as torch's interleaved schedules expect)."""
        return [self.stage + k * self.stages for k in range(virtual_stages)]


@dataclass(eq=False)  # hashable: registered to be closed at exit
class PipelineGroups:
    """The process groups of this rank: its stage's data-parallel group, its replica's pipeline
    group (both the mesh's), and one group per set of stages sharing a tied parameter (``ties``,
    created by :func:`pipeline_groups`; :meth:`close` destroys those)."""

    mesh: PipelineMesh
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    ties: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)

    def close(self) -> None:
        """Destroy the tie groups (the mesh's groups are the mesh's to close: Note [clean exit] in
        core/comm/process_groups.py)."""
        ties, self.ties = self.ties, {}
        for group in ties.values():
            if group is not None and dist.is_available() and dist.is_initialized():
                with suppress(ValueError):  # already destroyed
                    dist.destroy_process_group(group)


def pipeline_groups(mesh: ProcessMesh, tie_stage_sets: list[tuple[int, ...]], timeout_s: float) -> PipelineGroups:
    """This rank's pipeline groups: the stage's data-parallel (ZeRO) group and the replica's pipeline group
    from ``mesh`` (which must have been built with both axis sets), plus new groups for the tied stages
    (collective over the world: every rank calls it with the same arguments)."""
    view = PipelineMesh.of(mesh)
    dims = mesh.dims
    mine = PipelineGroups(view, mesh.group(*dims.zero_axes), mesh.group(Axis.PIPELINE))
    timeout = timedelta(seconds=timeout_s)
    for stages in tie_stage_sets:
        for replica in dims.all_groups((Axis.PIPELINE,)):  # one per data-parallel index, in rank order
            ranks = [replica[s] for s in stages]
            group = dist.new_group(ranks, timeout=timeout)
            if mesh.rank in ranks:
                mine.ties[stages] = group
    return mine
