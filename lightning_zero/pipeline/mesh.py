"""The 2D process layout of pipeline x data parallelism, and its process groups.

Note [rank layout]
    Global rank ``r`` holds pipeline stage ``r // dp`` and data-parallel index ``r % dp`` (``dp``
    = world size / stages): the ranks of one stage are contiguous, so with several ranks per node
    a stage's data-parallel collectives (ZeRO's reduce-scatter and gathers, the heavy traffic)
    stay on a node, while the pipeline's point-to-point activations cross nodes. With virtual
    stages, rank ``r`` runs model chunks ``r // dp + k * stages`` for ``k < virtual_stages``.

Every rank creates every group (``dist.new_group`` is collective over the world, in the same
order everywhere) and keeps the ones it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


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


@dataclass
class PipelineGroups:
    """The process groups of this rank: its stage's data-parallel group, its replica's pipeline
    group, and one group per set of stages sharing a tied parameter (``ties``)."""

    mesh: PipelineMesh
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    ties: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)


def make_groups(mesh: PipelineMesh, timeout_s: float, tie_stage_sets: list[tuple[int, ...]]) -> PipelineGroups:
    """Create the groups (collective over the world: every rank calls it with the same arguments)."""
    timeout = timedelta(seconds=timeout_s)
    mine = PipelineGroups(mesh, None, None)
    for s in range(mesh.stages):
        ranks = mesh.data_parallel_ranks(s)
        group = dist.new_group(ranks, timeout=timeout)
        if s == mesh.stage:
            mine.dp = group  # a one-rank group too: None would mean the world to DataParallelComm
    for d in range(mesh.dp_size):
        group = dist.new_group(mesh.pipeline_ranks(d), timeout=timeout)
        if d == mesh.dp_rank:
            mine.pp = group
    for stages in tie_stage_sets:
        for d in range(mesh.dp_size):
            group = dist.new_group([mesh.global_rank(s, d) for s in stages], timeout=timeout)
            if d == mesh.dp_rank and mesh.stage in stages:
                mine.ties[stages] = group
    return mine
