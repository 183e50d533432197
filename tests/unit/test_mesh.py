"""The device mesh's sizes, rank layout and groups, in one process."""

from __future__ import annotations

import pytest

from lightning_zero.core.mesh import Axis, ParallelDims, ProcessMesh


def test_data_is_what_the_model_dimensions_leave() -> None:
    dims = ParallelDims(8, pipeline=2, tensor=2)
    assert dims.data == 2 and dims.shape == (2, 2, 1, 2)
    assert dims.pipeline_enabled and dims.tensor_enabled and dims.data_enabled and not dims.sequence_enabled
    assert dims.describe() == "pipeline 2 x data 2 x tensor 2"
    assert ParallelDims(1).describe() == "data 1"


def test_tensor_is_innermost_and_pipeline_outermost() -> None:
    dims = ParallelDims(8, pipeline=2, tensor=2)
    assert dims.group_ranks(0, (Axis.TENSOR,)) == [0, 1]
    assert dims.group_ranks(5, (Axis.TENSOR,)) == [4, 5]
    assert dims.group_ranks(1, (Axis.DATA,)) == [1, 3]
    assert dims.group_ranks(1, (Axis.PIPELINE,)) == [1, 5]
    # the previous 2D layout: stage = rank // (world / stages)
    assert [dims.coordinates(r)[Axis.PIPELINE] for r in range(8)] == [r // 4 for r in range(8)]


def test_zero_partitions_over_data_and_sequence() -> None:
    dims = ParallelDims(8, sequence=2, tensor=2)
    assert dims.data == 2
    assert dims.group_ranks(0, dims.zero_axes) == [0, 2, 4, 6]
    assert dims.group_ranks(0, (Axis.SEQUENCE,)) == [0, 2]


@pytest.mark.parametrize("world,kw", [(8, dict(pipeline=2, sequence=2, tensor=2)), (12, dict(tensor=3, pipeline=2)),
                                      (6, dict(sequence=3))])
def test_coordinates_and_groups_partition_the_world(world: int, kw: dict) -> None:
    dims = ParallelDims(world, **kw)
    assert [dims.rank_of(dims.coordinates(r)) for r in range(world)] == list(range(world))
    for axes in [(Axis.DATA,), (Axis.TENSOR,), (Axis.PIPELINE,), (Axis.SEQUENCE,), dims.zero_axes]:
        groups = dims.all_groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == len(set(g)) for g in groups)


def test_bad_sizes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="not a multiple of pipeline x sequence x tensor = 1 x 1 x 4 = 4: launch"):
        ParallelDims(6, tensor=4)
    with pytest.raises(ValueError, match="tensor must be a positive integer"):
        ParallelDims(4, tensor=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        ParallelDims(4).coordinates(4)


def test_one_process_mesh_has_no_groups() -> None:
    mesh = ProcessMesh.single()
    assert mesh.group(Axis.DATA) is None and mesh.ranks(Axis.DATA) == [0]
    assert mesh.index(Axis.TENSOR) == 0
    mesh.close()


def test_the_mesh_answers_the_pipeline_and_the_sampler_from_its_coordinates() -> None:
    """What the pipeline's own rank arithmetic and the sampler's recomputed sizes did, the mesh says (issue 47):
    the same position in another stage, the data shard, and (in one process) no tie group."""
    dims = ParallelDims(8, pipeline=2, tensor=2)  # rank 5: stage 1, data 0, tensor 1
    mesh = ProcessMesh(dims, 5, [])
    assert mesh.index(Axis.PIPELINE) == 1 and mesh.peer(Axis.PIPELINE, 0) == 1
    assert mesh.data_shard == (2, 0) and ProcessMesh(dims, 7, []).data_shard == (2, 1)
    assert [mesh.peer(Axis.PIPELINE, s) for s in (0, 1)] == [ProcessMesh(dims, r, []).rank for r in (1, 5)]
    assert mesh.subgroup(Axis.PIPELINE, (0, 1)) is None  # no process group: every collective is local
    single = ProcessMesh.single()
    assert single.subgroup(Axis.PIPELINE, (0,)) is None and single.data_shard == (1, 0)


def test_the_engine_coupling_uses_the_mesh_model_parallel_comm_made_once() -> None:
    """The engine's norm / overflow coupling runs over the mesh's model-parallel comm (made with the mesh), not a
    comm built per engine; off when no pipeline or tensor parallelism holds part of the model."""
    from types import SimpleNamespace

    from lightning_zero.parallel.zero import model_parallel_coupling

    comm = object()
    mesh = SimpleNamespace(model_parallel=comm)
    tensor = SimpleNamespace(norm_weight=lambda p: 0.5)
    coupling = model_parallel_coupling(mesh, None, tensor)  # type: ignore[arg-type]
    assert coupling is not None and coupling.model_parallel is comm
    assert model_parallel_coupling(mesh, None, None) is None  # type: ignore[arg-type]
