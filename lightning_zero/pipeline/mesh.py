"""The pipeline's groups on the strategy's one mesh: this rank's stage, its stage's data-parallel group, its
replica's pipeline group, and the groups of the stages sharing a tied parameter.

Note [rank layout]
    The pipeline axis is outermost in Note [rank order] (``core/mesh/dims.py``): global rank ``r`` holds stage
    ``r // (world / stages)``, so the ranks of one stage are contiguous and a stage's data-parallel collectives
    (ZeRO's reduce-scatter and gathers, the heavy traffic) stay on a node, while the pipeline's point-to-point
    activations cross nodes. With virtual stages, rank ``r`` runs model chunks ``stage + k * stages`` for ``k <
    virtual_stages``. Every rank position is the mesh's: ``mesh.peer(Axis.PIPELINE, s)`` is the rank of stage
    ``s`` holding this rank's data, sequence and tensor position (over which activations and tied gradients go),
    and the groups of tied parameters are the mesh's too (``mesh.subgroup``), made from the stages that share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from lightning_zero.core.mesh import Axis, ProcessMesh


@dataclass(eq=False)
class PipelineGroups:
    """This rank's place in the pipeline and its groups, all the mesh's: its stage's data-parallel group
    (``dp``, ZeRO's), its replica's pipeline group (``pp``) and one group per set of stages sharing a tied
    parameter (``ties``; Note [rank layout])."""

    mesh: ProcessMesh
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    ties: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.mesh.index(Axis.PIPELINE)

    @property
    def stages(self) -> int:
        return self.mesh.dims.pipeline

    def peer(self, stage: int) -> int:
        """The global rank of ``stage`` that holds this rank's position in its stage."""
        return self.mesh.peer(Axis.PIPELINE, stage)


def pipeline_groups(mesh: ProcessMesh, tie_stage_sets: list[tuple[int, ...]]) -> PipelineGroups:
    """This rank's pipeline groups from ``mesh`` (built with the ZeRO and pipeline axis sets), the tied stages'
    among them (collective over the world the first time: every rank calls it with the same arguments)."""
    mine = PipelineGroups(mesh, mesh.group(*mesh.dims.zero_axes), mesh.group(Axis.PIPELINE))
    for stages in tie_stage_sets:
        group = mesh.subgroup(Axis.PIPELINE, stages)
        if mesh.index(Axis.PIPELINE) in stages:
            mine.ties[stages] = group
    return mine
