"""The strategy's device mesh: the sizes chosen in one place, the groups and the dimensions built on them.

Note [one mesh per strategy]
    A strategy makes one :class:`~lightning_zero.core.mesh.ProcessMesh` (every group it needs, created once,
    in the same order on every rank) and ZeRO's comm over ``zero_axes``; tensor and sequence parallelism take
    their groups from it. Later setups of the same strategy reuse it while its groups live; the mesh and the
    comm are registered to be closed before interpreter exit (Note [clean exit] in core/comm/process_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.process_groups import own, reusable
from lightning_zero.core.mesh import Axis, ParallelDims, ProcessMesh
from lightning_zero.core.zero.config import ZeroConfig
from lightning_zero.pipeline.config import PipelineConfig
from lightning_zero.sequence_parallel.lightning import StrategySequenceParallel
from lightning_zero.tensor_parallel.config import TensorParallelConfig
from lightning_zero.tensor_parallel.lightning import StrategyTensorParallel


def parallel_dims(world: int, pipeline: PipelineConfig | None, tensor: TensorParallelConfig,
                  sequence: int) -> ParallelDims:
    """The sizes of the parallel dimensions: the one place they are chosen."""
    sizes = {"tensor": tensor.size, "sequence": sequence}
    if pipeline is None:
        return ParallelDims(world, **sizes)
    pipeline.data_parallel_size(world)  # its error names the pipeline's fix
    return ParallelDims(world, pipeline=pipeline.stages, **sizes)


@dataclass(frozen=True)
class StrategyMesh:
    """What :func:`build_mesh` made: the mesh, ZeRO's comm over ``zero_axes`` and, when on, the tensor- and
    sequence-parallel dimensions."""

    mesh: ProcessMesh
    comm: DataParallelComm
    tensor: StrategyTensorParallel | None
    sequence: StrategySequenceParallel | None


def build_mesh(dims: ParallelDims, rank: int, tensor: TensorParallelConfig, zero: ZeroConfig) -> StrategyMesh:
    """Create the groups (collective over the world: every rank calls it with the same arguments); Note [one mesh
    per strategy]. The groups use the strategy's ``timeout_s``."""
    axis_sets = [dims.zero_axes] + [(a,) for a in (Axis.PIPELINE, Axis.SEQUENCE, Axis.TENSOR) if dims.enabled(a)]
    if dims.pipeline_enabled and dims.tensor_enabled:  # the engine's norm and overflow agreement: one group
        axis_sets.append((Axis.PIPELINE, Axis.TENSOR))
    mesh = own(ProcessMesh(dims, rank, axis_sets, zero.timeout_s))
    comm = own(DataParallelComm(mesh.group(*dims.zero_axes), zero.collective))
    return StrategyMesh(
        mesh, comm,
        StrategyTensorParallel(tensor, mesh) if dims.tensor_enabled else None,
        StrategySequenceParallel(mesh) if dims.sequence_enabled else None,
    )


def new_strategy_mesh(mesh: ProcessMesh | None, comm: DataParallelComm | None, pipeline: PipelineConfig | None,
                      tensor: TensorParallelConfig, sequence: int, zero: ZeroConfig) -> StrategyMesh | None:
    """A setup's groups: ``None`` when the strategy's ``mesh`` (and ``comm``) has these dimensions and its groups
    live, to be reused; else a new mesh (collective over the world). Note [one mesh per strategy]."""
    initialized = dist.is_available() and dist.is_initialized()
    dims = parallel_dims(dist.get_world_size() if initialized else 1, pipeline, tensor, sequence)
    if mesh is not None and mesh.dims == dims and reusable(comm):
        return None
    return build_mesh(dims, dist.get_rank() if initialized else 0, tensor, zero)
