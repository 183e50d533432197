"""The small shared helpers of the core: interval overlap (flat_param.overlap) and the all-ranks agreement
(DataParallelComm.extremes; its 2-rank path is exercised by the stage-3 divergent-units test)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.common.flat_param import overlap

bounds = st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted)


@given(bounds, bounds)
def test_overlap_is_the_intersection_of_two_ranges(a: list[int], b: list[int]) -> None:
    lo, hi = overlap(a[0], a[1], b[0], b[1])
    common = set(range(*a)) & set(range(*b))
    assert set(range(lo, hi)) == common
    if common:
        assert (lo, hi) == (min(common), max(common) + 1)
    else:
        assert hi <= lo


def test_extremes_without_a_group_is_the_value_itself() -> None:
    comm = DataParallelComm()
    assert not comm.active and comm.extremes(7) == (7, 7) and comm.extremes(-3) == (-3, -3)


def collectives_body() -> dict[str, object]:
    """Every gather / reduce-scatter path of ``DataParallelComm`` with FutureWarnings turned into errors."""
    import warnings

    import torch

    comm = DataParallelComm(collective="reduce_scatter")  # the gather / reduce-scatter path, also on gloo
    rank = comm.rank
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13: all_gather_into_tensor is deprecated
        flat = torch.zeros(4)
        flat[2 * rank:2 * rank + 2] = torch.tensor([1.0, 2.0]) + 10 * rank
        comm.all_gather_flat(flat, 2 * rank, 2 * rank + 2)
        out = torch.zeros(2)
        comm.reduce_scatter_pieces(out, [torch.full((2,), 1.0 + rank), torch.full((2,), 3.0 + rank)])
        gathered = torch.zeros(2)
        comm.all_gather(gathered, torch.tensor([5.0 + rank]))
    return {"flat": flat.tolist(), "scattered": out.tolist(), "gathered": gathered.tolist()}


@pytest.mark.distributed
def test_gathers_and_reduce_scatters_use_torchs_current_names(gloo_pool) -> None:
    """No ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` deprecation warning on any run."""
    rank0, rank1 = gloo_pool.run("tests.distributed.test_core_helpers:collectives_body")
    assert rank0["flat"] == rank1["flat"] == [1.0, 2.0, 11.0, 12.0]
    assert rank0["scattered"] == [3.0, 3.0] and rank1["scattered"] == [7.0, 7.0]
    assert rank0["gathered"] == rank1["gathered"] == [5.0, 6.0]


def test_gather_from_a_shard_without_peers_copies_it_into_its_range() -> None:
    import torch

    flat = torch.full((4,), float("nan"))
    DataParallelComm().all_gather_flat(flat, 1, 3, source=torch.tensor([5.0, 6.0])).wait()
    assert flat.tolist()[1:3] == [5.0, 6.0]


def gather_from_shard_body() -> dict[str, list[float]]:
    """``all_gather_flat(source=...)`` (Note [gather from the shard]) on gloo's broadcasts and on the
    ``all_gather_into_tensor`` path, with this rank's range of the buffer left unwritten (NaN) beforehand."""
    import torch

    out = {}
    for collective in ("auto", "reduce_scatter"):
        comm = DataParallelComm(collective=collective)
        rank = comm.rank
        flat = torch.full((4,), float("nan"))
        shard = torch.tensor([1.0, 2.0]) + 10 * rank
        comm.all_gather_flat(flat, 2 * rank, 2 * rank + 2, async_op=True, source=shard).wait()
        out[collective] = flat.tolist()
        out[collective + " shard"] = shard.tolist()
    return out


@pytest.mark.distributed
def test_gather_from_the_shard_fills_every_range_on_both_paths(gloo_pool) -> None:
    for rank, r in enumerate(gloo_pool.run("tests.distributed.test_core_helpers:gather_from_shard_body")):
        for collective in ("auto", "reduce_scatter"):
            assert r[collective] == [1.0, 2.0, 11.0, 12.0], (collective, r)
            assert r[collective + " shard"] == [1.0 + 10 * rank, 2.0 + 10 * rank], r  # the source is only read


def mesh_connected_body() -> dict[str, float]:
    """Rank 1 lingers 1 s after each of its ``new_group`` calls returns (a descheduled rank still finishing its
    side of a gloo pair); every rank notes when it left the mesh's construction and when its last group was made."""
    import time
    from unittest import mock

    import torch.distributed as dist

    from lightning_zero.core.mesh import ParallelDims, ProcessMesh
    from lightning_zero.core.mesh.dims import Axis

    made: list[float] = []
    real = dist.new_group

    def slow_new_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        group = real(*args, **kwargs)
        if dist.get_rank() == 1:
            time.sleep(1.0)
        made.append(time.time())
        return group

    with mock.patch.object(dist, "new_group", slow_new_group):
        ProcessMesh(ParallelDims(2), dist.get_rank(), [(Axis.DATA,)])
    return {"left": time.time(), "last_group": made[-1]}


@pytest.mark.distributed
def test_no_rank_leaves_a_gloo_meshs_construction_before_every_rank_has_made_every_group(gloo_pool) -> None:
    # Note [connected before used] in core/mesh/groups.py: a rank that leaves early and fails at once closes its
    # groups under a peer still connecting them
    first, second = gloo_pool.run("tests.distributed.test_core_helpers:mesh_connected_body")
    assert first["left"] >= second["last_group"], (first, second)
