"""The strategy's one mesh: the sizes chosen in one place (:func:`parallel_dims`), the process groups every
parallelism takes (:class:`~lightning_zero.core.mesh.ProcessMesh`), and the collectives over them that live as long
(:class:`StrategyMesh`: ZeRO's, and every rank's).

Note [one mesh per strategy]
    A strategy makes one :class:`~lightning_zero.core.mesh.ProcessMesh` (every group it needs, created once, in the same
    order on every rank: ZeRO's over ``zero_axes``, the pipeline's, tensor and sequence parallel's, expert parallel's
    (its all-to-alls' and the experts' ZeRO group), every rank's, and the groups of a pipeline's tied stages when the
    pipeline asks for them), and the collectives over them. Later setups of the same strategy reuse it while its groups
    live; the mesh and the collectives are registered to be closed before interpreter exit (Note [clean exit] in
    core/comm/process_groups.py). Its sizes are the settings tree's (``settings.parallel``) on the launched world: the
    data-parallel size is what they leave (``ParallelDims.data``), derived there alone, and this rank's data index is
    what a sampler reads (``ProcessMesh.data_shard``; the expert axis splits the data axis, so it is unchanged). A
    parallel dimension is an axis of ``core/mesh/dims.py``, its groups requested here, its size in the settings tree's
    ``ParallelSettings`` and its ``apply`` in ``parallel/`` (as expert parallelism's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.process_groups import own, reusable
from lightning_zero.core.mesh import ORDER, Axis, ParallelDims, ProcessMesh
from lightning_zero.core.settings.tree import ParallelSettings, Settings
from lightning_zero.core.settings.zero import ZeroConfig


def parallel_dims(world: int, parallel: ParallelSettings) -> ParallelDims:
    """The sizes of the parallel dimensions of ``world`` ranks: the one place they are chosen."""
    sizes = {"tensor": parallel.tensor.size, "sequence": parallel.sequence, "expert": parallel.experts}
    if parallel.pipeline is None:
        return ParallelDims(world, **sizes)
    parallel.pipeline.data_parallel_size(world)  # its error names the pipeline's fix
    return ParallelDims(world, pipeline=parallel.pipeline.stages, **sizes)


@dataclass(frozen=True)
class StrategyMesh:
    """The strategy's mesh and the collectives that live as long: ZeRO's over ``zero_axes`` (``comm``; with expert
    parallelism its ``expert_data``, the experts' over ``expert_zero_axes``) and every rank's holding part of the
    model (``everyone``, the step-error agreement: data x tensor x pipeline x sequence, the expert ranks being data
    ranks; ``comm`` itself when ZeRO's group is the world) and the ranks holding the rest of this rank's model
    (``model_parallel``: the pipeline and tensor axes that are on, over which the engine combines its gradient norm
    and overflow decision; ``None``: neither is on)."""

    mesh: ProcessMesh
    comm: DataParallelComm
    everyone: DataParallelComm
    model_parallel: DataParallelComm | None = None


def build_mesh(dims: ParallelDims, rank: int, zero: ZeroConfig) -> StrategyMesh:
    """Create the groups (collective over the world: every rank calls it with the same arguments); Note [one mesh
    per strategy]. The groups use the strategy's ``timeout_s``."""
    axis_sets = [dims.zero_axes] + [(a,) for a in (Axis.PIPELINE, Axis.SEQUENCE, Axis.TENSOR) if dims.enabled(a)]
    if dims.pipeline_enabled and dims.tensor_enabled:  # the engine's norm and overflow agreement: one group
        axis_sets.append((Axis.PIPELINE, Axis.TENSOR))
    if dims.expert_enabled:  # the all-to-alls' group, and the experts' ZeRO group (Note [expert axes])
        axis_sets += [(Axis.EXPERT,), dims.expert_zero_axes]
    beyond_zero = dims.pipeline_enabled or dims.tensor_enabled  # ZeRO's group is not every rank
    if beyond_zero:
        axis_sets.append(ORDER)
    mesh = own(ProcessMesh(dims, rank, axis_sets, zero.timeout_s))
    experts = (own(DataParallelComm(mesh.group(*dims.expert_zero_axes), zero.collective))
               if dims.expert_enabled else None)
    comm = own(DataParallelComm(mesh.group(*dims.zero_axes), zero.collective, expert_data=experts))
    everyone = own(DataParallelComm(mesh.group(*ORDER), zero.collective)) if beyond_zero else comm
    coupled = tuple(a for a in (Axis.PIPELINE, Axis.TENSOR) if dims.enabled(a))
    model_parallel = own(DataParallelComm(mesh.group(*coupled), zero.collective)) if coupled else None
    return StrategyMesh(mesh, comm, everyone, model_parallel)


def open_mesh(settings: Settings, previous: StrategyMesh | None) -> StrategyMesh:
    """This setup's mesh: ``previous`` while it has these sizes and its groups live, else a new one (collective over
    the world). Note [one mesh per strategy]."""
    initialized = dist.is_available() and dist.is_initialized()
    dims = parallel_dims(dist.get_world_size() if initialized else 1, settings.parallel)
    if previous is not None and previous.mesh.dims == dims and reusable(previous.comm):
        return previous
    return build_mesh(dims, dist.get_rank() if initialized else 0, settings.zero)
